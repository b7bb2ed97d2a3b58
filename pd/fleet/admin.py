"""``ClusterAdmin``: what the admin API and the autoscaler may do to a running cluster.

Everything here runs on the cluster client's event loop (the HTTP server's): reading the pools
(``nodes``: one ``NodeView`` per node, from its latest stats), setting their target sizes
(``scale``, after ``check_capacity``, which asks Ray off the loop), draining one node
(``drain``), and prefilling prompts into the caches of the prefill nodes the coordinator
routes them to (``warmup``). Sizes set here are the operator's: the autoscaler is told.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from pd.cluster.client import ClusterClient, WarmResult
from pd.cluster.client_config import ROLES
from pd.core.messages import NodeInfo, NodeStatsMsg
from pd.fleet.launcher import Cluster
from pd.fleet.pools import NodeState

if TYPE_CHECKING:
    from pd.fleet.autoscaler import Autoscaler

STATES = ("starting", "ready", "draining")  # the NodeState values a view shows


class NodeView(NamedTuple):
    """One node as ``GET /admin/nodes`` shows it (zeros while it starts: no stats yet)."""

    id: str
    role: str
    ray_node: str  # the Ray node it was placed on
    state: str  # one of STATES
    load: int  # requests running or waiting there
    queued_tokens: int  # prompt tokens waiting or being prefilled there
    kv_usage: float  # KV slots held by requests / all slots (cached prefixes not counted)
    cached_tokens: int
    host_cached_tokens: int  # held in its host tier, below the pool
    pulled_tokens: int  # prompt tokens whose KV it pulled from another node
    pulls_served: int  # prefixes it sent to nodes that pulled them
    slots_in_use: int  # held by requests (0 when idle: a leak check)
    pair_groups: int
    threads: int
    sockets: int
    pid: int  # its process (0 while it starts)
    addr: str  # its request socket ("" while it starts)
    transfer_addr: str  # its transfer control endpoint


class PoolSizes(NamedTuple):
    prefill: int
    decode: int


class ClusterAdmin:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.autoscaler: Autoscaler | None = None  # with ``pd serve --autoscale``
        self._warm_ids = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()

    def start_autoscaler(self, autoscaler: Autoscaler) -> None:
        """Run ``autoscaler`` on this (the running) event loop."""
        self.autoscaler = autoscaler
        task = asyncio.get_running_loop().create_task(autoscaler.run())
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

    @property
    def client(self) -> ClusterClient:
        return self.cluster.client

    def target(self) -> PoolSizes:
        return PoolSizes(**self.cluster.target)

    def pulls(self, last: int = 32) -> dict[str, Any]:
        """The coordinator's pull counts and its ``last`` pull-or-compute decisions."""
        log = self.client.pull_log
        return {
            "num_pulls": log.num_pulls,
            "num_computed": log.num_computed,
            "num_fallbacks": log.num_fallbacks,
            "num_pulled_tokens": log.num_pulled_tokens,
            "pull_seconds": log.pull_seconds,
            "decisions": [dataclasses.asdict(d) for d in list(log.decisions)[-last:]],
        }

    def routes(self, request_id: str) -> list[dict[str, Any]]:
        """Where each attempt of ``request_id`` went (the coordinator's route log)."""
        return [r._asdict() for r in self.client.routes_of(request_id)]

    def nodes(self) -> list[NodeView]:
        pools, stats = self.cluster.pools, self.client.membership.node_stats
        starting = pools.nodes(NodeState.STARTING)
        views = [_view(n.node_id, n.role, n.state.value, None, None) for n in starting]
        for node_id, info in self.client.membership.nodes.items():  # ready or draining
            state = pools[node_id].state.value
            views.append(_view(node_id, info.role, state, info, stats.get(node_id)))
        return sorted(views, key=lambda v: (ROLES.index(v.role), pools[v.id].index))

    def check_capacity(
        self, prefill: int | None = None, decode: int | None = None
    ) -> CapacityRefusal | None:
        """Why a pool cannot grow to the size asked (past what the Ray cluster can hold, with
        the numbers), or None; shrinking or keeping a size is always possible. Blocking (it
        asks Ray): call it off the event loop, then ``scale``."""
        asked = _targets(prefill, decode)
        now = self.cluster.target
        for role, n in asked.items():
            if n <= now[role]:
                continue
            other = next(r for r in ROLES if r != role)
            capacity = self.cluster.capacity(role, max(now[other], asked.get(other, 0)))
            if n > capacity.max_nodes:
                return CapacityRefusal(
                    role,
                    f"asked for {n} {role} nodes, the cluster can place at most "
                    f"{capacity.max_nodes}: {capacity.why}",
                )
        return None

    def scale(self, prefill: int | None = None, decode: int | None = None) -> PoolSizes:
        """Set the pools' target sizes (ValueError below ``MIN_POOL``: prefill 0, decode 1), as
        the operator's: the autoscaler keeps a size outside its range until the operator
        changes it; returns the targets."""
        targets = _targets(prefill, decode)
        self.cluster.scale(**targets)
        self._tell_autoscaler(targets)
        return self.target()

    def drain(self, node_id: str) -> PoolSizes:
        """KeyError: no such ready node; ValueError: it is the last of its pool."""
        nodes = self.client.membership.nodes
        role = nodes[node_id].role if node_id in nodes else None
        self.cluster.drain(node_id)
        if role is not None:
            self._tell_autoscaler({role: self.cluster.target[role]})
        return self.target()

    def _tell_autoscaler(self, targets: dict[str, int]) -> None:
        if self.autoscaler is not None:
            for role, n in targets.items():
                self.autoscaler.set_by_operator(role, n)

    async def warmup(self, prompts: Sequence[list[int]], namespace: str = "") -> list[WarmResult]:
        """Prefill each prompt where the coordinator routes it; concurrently, like requests."""
        ids = [f"warmup-{next(self._warm_ids)}" for _ in prompts]
        return list(
            await asyncio.gather(*(self.client.warm(i, p, namespace) for i, p in zip(ids, prompts)))
        )


class CapacityRefusal(NamedTuple):
    role: str  # the pool that cannot grow so far
    message: str


def _targets(prefill: int | None, decode: int | None) -> dict[str, int]:
    return {r: n for r, n in (("prefill", prefill), ("decode", decode)) if n is not None}


def _view(
    node_id: str, role: str, state: str, info: NodeInfo | None, s: NodeStatsMsg | None
) -> NodeView:
    ray_node, pid, addr, transfer_addr = (
        (info.ray_node_id, info.pid, info.addr, info.transfer_addr) if info else ("", 0, "", "")
    )
    if s is None:
        return NodeView(
            node_id, role, ray_node, state, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0, pid, addr,
            transfer_addr,
        )  # fmt: skip
    in_use = s.num_slots - s.num_free_slots - s.num_cached_tokens
    return NodeView(
        id=node_id,
        role=role,
        ray_node=ray_node,
        state=state,
        load=s.num_running + s.num_waiting,
        queued_tokens=s.num_queued_tokens,
        kv_usage=in_use / s.num_slots if s.num_slots else 0.0,
        cached_tokens=s.num_cached_tokens,
        host_cached_tokens=s.num_host_cached_tokens,
        pulled_tokens=s.num_pulled_tokens,
        pulls_served=s.num_pulls_served,
        slots_in_use=in_use,
        pair_groups=s.num_pairs,
        threads=s.num_threads,
        sockets=s.num_sockets,
        pid=pid,
        addr=addr,
        transfer_addr=transfer_addr,
    )
