"""``Lifecycle``: each node's life, one step a method, for the launcher (``pd.fleet.launcher``):
launched (its actor started: ``starting``), joined (registered with the cluster client:
``ready``), drained (``draining``; once its requests are done or its drain deadline passed, it
leaves the client and its actor is stopped: ``gone``). A start that fails lowers its pool's
target. After a node joins or leaves, ``on_change`` (the launcher's reconcile) runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pd.cluster.event_loop import TaskSet
from pd.cluster.membership import Membership
from pd.core.messages import NodeInfo
from pd.executor.config import EngineConfig
from pd.fleet.actors import NodeActors
from pd.fleet.config import ClusterConfig
from pd.fleet.pools import NodeState, Pools

if TYPE_CHECKING:
    import ray

logger = logging.getLogger(__name__)


class Lifecycle:
    def __init__(
        self,
        cfg: ClusterConfig,
        pools: Pools,
        actors: NodeActors,
        membership: Membership,
        tasks: TaskSet,
        on_change: Callable[[], None],
    ) -> None:
        """``membership``: the cluster client's (nodes register, drain and leave there);
        ``tasks``: where drains run; ``on_change()``: after a node joined or left."""
        self.cfg = cfg
        self.pools = pools
        self.actors = actors
        self.membership = membership
        self._tasks = tasks
        self._on_change = on_change

    def launch(
        self, role: str, engine_cfg: EngineConfig, addr: str, secret: bytes
    ) -> tuple[str, ray.ObjectRef[NodeInfo]] | None:
        """Start a ``role`` actor (``starting`` from now on); None if Ray refused it, which
        lowers the pool's target."""
        node = self.pools.new_node(role)
        try:
            ref = self.actors.start(node, engine_cfg, addr, secret)
        except Exception:
            logger.exception("could not start a %s node: the pool's target drops back", role)
            node.set_state(NodeState.GONE)
            self.pools.set_target(role, max(1, self.pools.target[role] - 1))
            return None
        self.membership.begin_start(role)  # requests wait for it rather than fail
        return node.node_id, ref

    async def join(self, role: str, node_id: str, ref: ray.ObjectRef[NodeInfo]) -> str | None:
        """Wait for the started ``node_id`` and register it; a failed start is stopped and
        lowers the pool's target."""
        info: NodeInfo | None = None
        try:
            info = await asyncio.wait_for(ref, self.cfg.ready_timeout_s)
        except Exception:
            logger.exception("could not start %s: the %s pool's target drops back", node_id, role)
            self.pools.set_target(role, max(1, self.pools.target[role] - 1))
            self.actors.stop(node_id)
        finally:
            self.membership.end_start(role)
            if info is None:  # failed, or cancelled: it never joins
                self.pools[node_id].set_state(NodeState.GONE)
        if info is None:
            return None
        self.membership.register_node(info)
        self.pools.joined(node_id)
        logger.warning(
            "%s joined (%s pool: %d) at %s, transfers at %s",
            node_id, role, len(self.pools.ready(role)), info.addr, info.transfer_addr,
        )  # fmt: skip
        self._on_change()
        return node_id

    def begin_drain(self, node_id: str) -> None:
        """Mark ``node_id`` draining at once (``Cluster.nodes_of`` no longer counts it, so a
        reconcile that runs before it has left chooses no second node), and let it leave in
        the background."""
        self.pools[node_id].set_state(NodeState.DRAINING)
        self.membership.drain_node(node_id)  # the coordinator routes nothing new to it
        self._tasks.spawn(self.drain(node_id))

    async def drain(self, node_id: str) -> None:
        """Wait until the draining ``node_id`` has finished its requests (or the drain deadline
        passed), then remove it and stop its actor."""
        deadline = time.monotonic() + self.cfg.drain_deadline_s
        try:
            while time.monotonic() < deadline and self.pools[node_id].actor is not None:
                if not self.membership.num_routed_to(node_id):
                    try:
                        if await self.actors.num_unfinished(node_id) == 0:
                            break
                    except Exception:  # died meanwhile: the watchdog drops it
                        break
                await asyncio.sleep(0.05)
            # the others close their pair groups to it
            self.membership.unregister_node(node_id)
            await self.actors.stop_async(node_id)
        finally:
            self.pools[node_id].set_state(NodeState.GONE)
        logger.warning("%s drained and stopped", node_id)
        self._on_change()
