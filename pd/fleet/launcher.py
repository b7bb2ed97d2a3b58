"""``Cluster``: places prefill and decode nodes as Ray actors and wires them to the server.

Ray is the lifecycle plane only (placement, health, replacing dead nodes, scaling): every Ray
call is in ``NodeActors`` (``pd.fleet.actors``); requests, tokens, cache events and transfer
handshakes never go through Ray. Locally (``address=None``) a private Ray instance is always
started, with the nodes as CPU actors, whatever other Ray cluster (live, or dead with its record
left behind) the machine has; with ``address="auto"`` (or a Ray address) the nodes join that
cluster, one GPU each, and an unreachable one is an error within seconds. There the nodes are
detached actors named by their node id in the Ray namespace ``namespace``: they outlive the
server, and a server that starts while some run attaches to them (``_attach``: their secret and
settings are adopted, their old requests aborted, their caches mirrored from snapshots) instead
of starting new ones. ``prefill_resources`` and ``decode_resources`` pin each role to Ray custom
resources, so each pool lands (and, with Ray's autoscaler, scales) on its own machine type: pd
decides how many nodes, Ray decides where.

Each pool has a target size (``scale``, the admin API, the autoscaler); ``_reconcile`` starts
nodes or drains the surplus until the pool matches it, and again whenever a node joins, leaves
or dies. The prefill pool's may be 0 (``MIN_POOL``; ``pd serve``'s default on one CPU machine):
while it has no node, and is not waiting for a dead one's replacement, the coordinator sends
every request to a decode node alone (``Membership.set_decode_only``). Each node's life is one
record in ``Pools`` (``pd.fleet.pools``): ``starting`` (its actor started, not registered),
``ready``, ``draining`` (no new requests; in-flight ones finish within ``drain_timeout_s``, then
it leaves, its peers close their pair groups to it, and its actor is stopped), ``gone``; each
step is a method of ``Lifecycle`` (``pd.fleet.lifecycle``). A start that fails lowers the
target again. The record keeps the node's role and number in its pool:
nothing reads them back out of a node id but attaching, which finds nodes by their names. The
launcher tells the client about nodes through the client's ``membership`` (``register_node``,
``drain_node``, ``unregister_node``, ``begin_start``/``end_start``, ``set_decode_only``), reads
them back through its read-only views (``nodes``, ``node_stats``) and hears of deaths through
``on_node_failed``; it never reaches the coordinator.

The launcher makes the cluster's secret, which every zmq frame and pair rendezvous is
authenticated with, and hands it to the client and (through Ray, inside ``TransferConfig``) to
every node; it never goes on a command line or into a log.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from pd.cluster.client import ClusterClient
from pd.cluster.client_config import MIN_POOL, ROLES
from pd.cluster.event_loop import TaskSet
from pd.core.addresses import choose_addrs
from pd.executor.config import EngineConfig
from pd.fleet.actors import STOP_TIMEOUT_S, NodeActors
from pd.fleet.config import ClusterConfig, free_port
from pd.fleet.lifecycle import Lifecycle
from pd.fleet.placement import (
    Capacity,
    node_demand,
    pool_capacity,
    ray_autoscaler_max,
    ray_totals,
    socket_capacity,
)
from pd.fleet.pools import NodeState, Pools
from pd.model.loader import resolve_model
from pd.router.coordinator import Coordinator
from pd.router.policy import CoordinatorConfig
from transfer.auth import new_secret

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Cluster:
    def __init__(
        self, engine_cfg: EngineConfig, cfg: ClusterConfig, coordinator: CoordinatorConfig
    ) -> None:
        self.engine_cfg = engine_cfg
        self.cfg = cfg
        self.coordinator_cfg = dataclasses.replace(coordinator, page_size=engine_cfg.page_size)
        self._secret = new_secret()
        self.pools = Pools(cfg.num_prefill, cfg.num_decode)
        self.actors = NodeActors(cfg, self.pools)
        self.client = ClusterClient(
            Coordinator(self.coordinator_cfg),
            "tcp://127.0.0.1:0",  # replaced in start(), once Ray tells this machine's IP
            cfg.client,
            secret=self._secret,
            ping=self.actors.ping,
            on_node_failed=self._on_node_failed,
            resync=self.actors.resync,
            max_msg_age_s=cfg.transfer.max_msg_age_s,
            max_conns=cfg.transfer.max_conns,
        )
        self._stopping = False
        self._tasks = TaskSet()
        self.life = Lifecycle(
            cfg, self.pools, self.actors, self.client.membership, self._tasks, self._reconcile
        )

    @property
    def target(self) -> dict[str, int]:
        """Each pool's target size (a copy)."""
        return dict(self.pools.target)

    @property
    def attached(self) -> list[str]:
        """The nodes that ran before this server started."""
        return [n.node_id for n in self.pools.nodes() if n.is_attached]

    # -- start / stop -----------------------------------------------------------------------

    def start(self) -> None:
        node_ip = self.actors.connect()
        addrs = choose_addrs(self.cfg.host, node_ip)
        port = free_port(addrs.bind_host)
        self.client.listen_at(addrs.bind(port), addrs.endpoint(port))
        running = self.actors.find_running() if self.actors.is_detached else {}
        if running:
            self._attach(running)
        # _reconcile keeps it from here on (the nodes below register on the loop, maybe later)
        self.client.membership.set_decode_only(self.pools.target["prefill"] == 0)
        started = []
        for role in ROLES:
            for _ in range(self.pools.target[role] - len(self.pools.ready(role))):
                node = self.pools.new_node(role)
                ref = self.actors.start(node, self.engine_cfg, self.client.addr, self._secret)
                started.append((node, ref))
        try:
            infos = self.actors.wait_started([ref for _, ref in started])
        except BaseException:
            for node, _ in started:  # no longer starting: the server fails to start
                node.set_state(NodeState.GONE)
            raise
        for (node, _), info in zip(started, infos):
            self.pools.joined(node.node_id)
            self.client.membership.register_node(info)

    def shutdown(self) -> None:
        self._stopping = True
        if self.actors.is_detached and self.cfg.keep_nodes:
            logger.warning(
                "leaving %d nodes running in Ray namespace %r: the next `pd serve --address` "
                "attaches to them",
                len(self.actors.running()),
                self.cfg.namespace,
            )
            return
        for node_id in self.actors.running():
            self.actors.stop(node_id, wait_s=STOP_TIMEOUT_S)

    def _attach(self, running: dict[str, Any]) -> None:
        """Adopt the ``running`` nodes: their secret and engine settings, and each as a ready
        node of its pool."""
        settings = self.actors.settings_of(running)
        self._secret = settings.node.transfer.secret
        self.client.use_secret(self._secret)
        adopted = dataclasses.replace(settings.engine, num_threads=self.engine_cfg.num_threads)
        check_adoptable(adopted, self.engine_cfg)
        if adopted != self.engine_cfg:
            logger.warning("attached nodes run %s; new nodes will too", adopted)
        self.engine_cfg = adopted
        infos = self.actors.attach(running, self.client.addr)
        for node_id, info in zip(running, infos):
            self.pools.adopt(node_id, info.role, running[node_id])
            self.client.membership.register_node(info, attached=True)
        logger.warning("attached to %d running nodes: %s", len(running), sorted(running))

    # -- pools ------------------------------------------------------------------------------

    def nodes_of(self, role: str) -> list[str]:
        """Registered nodes of ``role`` that are not draining."""
        return self.pools.ready(role)

    def is_pending(self, role: str) -> bool:
        """A node of ``role`` is starting or draining (a scale is under way)."""
        return self.pools.is_pending(role)

    def scale(self, **targets: int) -> None:
        """Set pool targets (``prefill=`` >= 0, ``decode=`` >= 1); nodes start or drain in the
        background. Call on the client's event loop."""
        for role, n in targets.items():
            if role not in ROLES or n < MIN_POOL[role]:
                raise ValueError(f"pool sizes must be >= {MIN_POOL} for {ROLES}, got {role}={n}")
        for role, n in targets.items():
            self.pools.set_target(role, n)
        self._reconcile()

    def capacity(self, role: str, num_other: int) -> Capacity:
        """How many ``role`` nodes the Ray cluster can hold beside ``num_other`` nodes of the
        other pool (``pd.fleet.placement``), and the server's socket can take (its
        ``--transfer-max-conns``). Blocking (it asks Ray): not on the event loop.
        A CPU node takes in memory the largest resident size a node reports, or before any
        has, its checkpoint's weight files."""
        other = next(r for r in ROLES if r != role)
        memory = float(
            max((s.rss_bytes for s in self.client.membership.node_stats.values()), default=0)
        )
        if not memory:
            model_dir = resolve_model(self.engine_cfg.model)
            memory = float(sum(p.stat().st_size for p in model_dir.glob("*.safetensors")))
        cap = pool_capacity(
            role,
            node_demand(
                self.actors.gpus_of(role, self.engine_cfg), self.cfg.resources(role), memory
            ),
            other,
            node_demand(
                self.actors.gpus_of(other, self.engine_cfg), self.cfg.resources(other), memory
            ),
            num_other,
            ray_totals(is_local=self.cfg.address is None),
            ray_autoscaler_max(),
        )
        return socket_capacity(cap, num_other, self.cfg.transfer.max_conns)

    def drain(self, node_id: str) -> None:
        """Drain ``node_id`` and remove it; its pool's target drops by one. Call on the
        client's event loop."""
        role = self.pools.ready_node(node_id).role
        if self.pools.target[role] <= MIN_POOL[role]:
            keeps = MIN_POOL[role]
            raise ValueError(f"{node_id} is the last {role} node: the pool keeps {keeps}")
        self.pools.set_target(role, self.pools.target[role] - 1)
        self.life.begin_drain(node_id)  # before reconciling: it must count as leaving already
        self._reconcile()

    def _sync_decode_only(self) -> None:
        """Requests go to a decode node alone (``Coordinator.decode_only``) while the prefill
        pool has no node: empty by choice (target 0), or growing from empty (its first node
        starts). Not while a dead node's replacement starts: then they wait for it, as the
        operator asked for a prefill pool and a decode node's long prefills would stretch the
        running streams' TPOT."""
        self.client.membership.set_decode_only(
            not self.pools.ready("prefill") and not self.pools.num_replacing("prefill")
        )

    def _reconcile(self) -> None:
        self._sync_decode_only()
        if self._stopping:
            return
        for role in ROLES:
            ready = self.pools.ready(role)
            num_starting = len(self.pools.nodes(NodeState.STARTING, role))
            surplus = len(ready) + num_starting - self.pools.target[role]
            for _ in range(-surplus):
                # started here, not in the task: a second reconcile before the task's first
                # turn (a scale right after a drain) counts it as starting, not as missing
                started = self.life.launch(role, self.engine_cfg, self.client.addr, self._secret)
                if started is not None:
                    self._tasks.spawn(self.life.join(role, *started))
            n = min(surplus, len(ready))
            for node_id in self.pools.victims(ready, n, self.client.membership.node_stats):
                self.life.begin_drain(node_id)

    def _on_node_failed(self, node_id: str) -> None:
        """Called on the client's event loop when the watchdog finds a node dead."""
        self.actors.stop(node_id)
        node = self.pools[node_id]
        if node.state is NodeState.READY:  # a draining one is done with by its drain
            node.set_state(NodeState.GONE)
        if self._stopping:
            return
        if self.cfg.replace_dead_nodes:
            self.pools.begin_replacing(node.role)
            logger.warning("starting a %s node in place of %s", node.role, node_id)
        else:
            self.pools.set_target(node.role, max(1, self.pools.target[node.role] - 1))
        self._reconcile()

    # -- from other threads -----------------------------------------------------------------

    def add_node(self, role: str) -> str:
        """Start one more node of ``role`` and wait until it is registered."""
        node_id = self._wait(self._grow(role))
        if node_id is None:
            raise RuntimeError(f"could not start a {role} node (see the log)")
        return node_id

    def remove_node(self, node_id: str, timeout_s: float = 120.0) -> None:
        """Drain a node (no new requests, in-flight ones finish), then stop its actor."""
        self._wait(self._drain_now(node_id), timeout_s + 30)

    def check_integrity(self) -> dict[str, dict[str, int]]:
        """Every registered node's slot and resource accounting (asserts inside each node);
        nodes still starting are not waited for."""
        registered = self.client.membership.nodes  # a read-only view
        return self.actors.check_integrity([n for n in self.actors.running() if n in registered])

    async def _grow(self, role: str) -> str | None:
        """One more ``role`` node: started and registered (None: its start failed)."""
        self.pools.set_target(role, self.pools.target[role] + 1)
        started = self.life.launch(role, self.engine_cfg, self.client.addr, self._secret)
        return None if started is None else await self.life.join(role, *started)

    async def _drain_now(self, node_id: str) -> None:
        role = self.pools.ready_node(node_id).role
        self.pools.set_target(role, self.pools.target[role] - 1)
        self.pools[node_id].set_state(NodeState.DRAINING)
        self.client.membership.drain_node(node_id)  # the coordinator routes nothing new to it
        self._sync_decode_only()
        await self.life.drain(node_id)

    def _wait(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the client's event loop (from another thread) and wait for it."""
        loop = self.client.loop
        if loop is None or not loop.is_running():
            return asyncio.run(coro)
        timeout_s = timeout_s or self.cfg.ready_timeout_s + 30
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)


def check_adoptable(running: EngineConfig, asked: EngineConfig) -> None:
    """Raise, naming the flag to pass, where the running nodes' settings ``running`` differ
    from ``asked`` in what a node cannot take from a peer: the page size (the coordinator
    mirrors caches by pages) and the KV's dtype (a node refuses KV of another; a mixed
    cluster is a configuration error). Anything else the new nodes adopt from them."""
    for name, flag in (("page_size", "--page-size"), ("kv_cache_dtype", "--kv-cache-dtype")):
        have, want = getattr(running, name), getattr(asked, name)
        if have != want:
            raise ValueError(
                f"the running nodes use {name} {have}, not {want}: start with {flag} {have}"
            )
