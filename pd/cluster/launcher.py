"""``Cluster``: places prefill and decode nodes as Ray actors and wires them to the server.

Ray is the lifecycle plane only (placement, health, replacing dead nodes, scaling); requests,
tokens, cache events and transfer handshakes never go through Ray. Locally (``address=None``) a
private Ray instance is always started, with the nodes as CPU actors, whatever other Ray cluster
(live, or dead with its record left behind) the machine has; with ``address="auto"`` (or a Ray
address) the nodes join that cluster, one GPU each, and an unreachable one is an error within
seconds. There the nodes are detached actors named by their node id in the Ray namespace
``namespace``: they outlive the server, and a server that starts while some run attaches to
them (``attach``: their secret and settings are adopted, their old requests aborted, their
caches mirrored from snapshots) instead of starting new ones. ``prefill_resources`` and
``decode_resources`` pin each role to Ray custom resources, so each pool lands (and, with Ray's
autoscaler, scales) on its own machine type: pd decides how many nodes, Ray decides where.

Each pool has a target size (``scale``, the admin API, the autoscaler); ``_reconcile`` starts
nodes or drains the surplus until the pool matches it, and again whenever a node joins, leaves
or dies. The prefill pool's may be 0 (``MIN_POOL``; ``pd serve``'s default on one CPU machine):
while it has no node, and is not waiting for a dead one's replacement, the coordinator sends
every request to a decode node alone (``Coordinator.decode_only``). A node is ``starting`` (its actor started, not registered), ``ready``, or
``draining`` (no new requests; in-flight ones finish within ``drain_timeout_s``, then it
leaves, its peers close their pair groups to it, and its actor is stopped). A start that fails
lowers the target again. The launcher records each node's role and number as it starts it
(``launched``): nothing reads them back out of a node id.

The launcher makes the cluster's secret, which every zmq frame and pair rendezvous is
authenticated with, and hands it to the client and (through Ray, inside ``TransferConfig``) to
every node; it never goes on a command line or into a log.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import re
import time
from collections.abc import Coroutine
from typing import Any, NamedTuple, TypeVar

import ray

from pd.cluster.client import MIN_POOL, ROLES, ClusterClient
from pd.cluster.config import ClusterConfig, free_port, init_ray
from pd.cluster.coordinator import Coordinator, CoordinatorConfig
from pd.cluster.node_actor import ACTOR_CLASSES
from pd.cluster.placement import (
    Capacity,
    node_demand,
    pool_capacity,
    ray_autoscaler_max,
    ray_totals,
)
from pd.core import envs
from pd.core.addresses import choose_addrs, cluster_node_ip, node_bind_host
from pd.core.messages import NodeInfo
from pd.engine.config import EngineConfig
from pd.model.loader import resolve_model
from pd.node import NodeConfig, NodeSettings
from transfer.auth import new_secret

__all__ = ["Cluster", "ClusterConfig", "init_ray"]
logger = logging.getLogger(__name__)
T = TypeVar("T")
_NODE_ID = re.compile(r"^(prefill|decode)-(\d+)$")  # ``LaunchedNode.node_id``: attach finds these
STOP_TIMEOUT_S = 15.0  # a node's own shutdown, before its actor is killed
# Iterations an idle OpenMP thread of a CPU prefill node spins before it sleeps: libgomp's own
# count for a process with more threads than cores (its default, 300,000, is for a process that
# has the cores to itself). The CPU nodes share this machine's cores, and a prefill node's
# threads spinning between its parallel regions hold cores a decoding node needs. Decode nodes
# keep the default: they run without pause, and alone ran 14% more steps with it. A prefill of
# 256 tokens beside a decoding node: 1.27 s with both at the default, 0.75 s with this, and the
# decode node made 35% more steps (BENCHMARKS.md, "OpenMP threads that share the cores").
PREFILL_SPIN_COUNT = 1000
_OMP_WAIT_VARS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


class LaunchedNode(NamedTuple):
    """A node this launcher started or attached to: its role and its number in that pool."""

    role: str
    index: int  # the pool's count when it started

    @property
    def node_id(self) -> str:
        return f"{self.role}-{self.index}"


class Cluster:
    def __init__(
        self, engine_cfg: EngineConfig, cfg: ClusterConfig, coordinator: CoordinatorConfig
    ) -> None:
        self.engine_cfg = engine_cfg
        self.cfg = cfg
        self.coordinator_cfg = dataclasses.replace(coordinator, page_size=engine_cfg.page_size)
        self._secret = new_secret()
        self.client = ClusterClient(
            Coordinator(self.coordinator_cfg),
            "tcp://127.0.0.1:0",  # replaced in start(), once Ray tells this machine's IP
            cfg.client,
            secret=self._secret,
            ping=self._ping,
            on_node_failed=self._on_node_failed,
            resync=self._resync,
            max_msg_age_s=cfg.transfer.max_msg_age_s,
        )
        self.actors: dict[str, Any] = {}  # node id -> Ray actor, until it is stopped
        # node id -> role and number of every node started or attached (ids are not reused)
        self.launched: dict[str, LaunchedNode] = {}
        self.target = {"prefill": cfg.num_prefill, "decode": cfg.num_decode}
        self.starting: dict[str, str] = {}  # node id -> role: actor started, not registered yet
        self.draining: dict[str, str] = {}  # node id -> role: leaving after its requests
        self.attached: list[str] = []  # nodes that ran before this server started
        self.replacements: list[str] = []  # node ids started in place of dead ones
        self._ids = {"prefill": itertools.count(), "decode": itertools.count()}
        self._gpus = 0.0  # each node's (ClusterConfig.node_gpus, resolved in start())
        self._stopping = False
        self._num_replacing = dict.fromkeys(ROLES, 0)  # deaths not yet made up for
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def is_detached(self) -> bool:
        """Nodes are detached, named actors in ``namespace`` (a shared Ray cluster)."""
        return self.cfg.address is not None

    # -- start / stop -----------------------------------------------------------------------

    def start(self) -> None:
        if not ray.is_initialized():
            init_ray(self.cfg)
        has_gpus = self.is_detached and ray.cluster_resources().get("GPU", 0) > 0
        self._gpus = self.cfg.node_gpus if self.cfg.node_gpus is not None else float(has_gpus)
        node_ip = cluster_node_ip(self.cfg.address is None, ray.util.get_node_ip_address())
        addrs = choose_addrs(self.cfg.host, node_ip)
        port = free_port(addrs.bind_host)
        self.client.listen_at(addrs.bind(port), addrs.endpoint(port))
        running = self._find_running() if self.is_detached else {}
        if running:
            self._attach(running)
        # _reconcile keeps it from here on (the nodes below register on the loop, maybe later)
        self.client.coordinator.decode_only = self.target["prefill"] == 0
        refs = []
        for role in ROLES:
            for _ in range(self.target[role] - len(self.nodes_of(role))):
                refs.append(self._start_actor(role)[1])
        try:
            infos = ray.get(refs, timeout=self.cfg.ready_timeout_s)
        finally:
            self.starting.clear()
        for info in infos:
            self.client.register_node(info)

    def shutdown(self) -> None:
        self._stopping = True
        if self.is_detached and self.cfg.keep_nodes:
            logger.warning(
                "leaving %d nodes running in Ray namespace %r: the next `pd serve --address` "
                "attaches to them",
                len(self.actors),
                self.cfg.namespace,
            )
            return
        for node_id in list(self.actors):
            self._stop_actor(node_id, wait_s=STOP_TIMEOUT_S)

    # -- attaching to running nodes ---------------------------------------------------------

    def _find_running(self) -> dict[str, Any]:
        """The live pd nodes in this cluster's namespace, by node id."""
        found: dict[str, Any] = {}
        for entry in ray.util.list_named_actors(all_namespaces=True):
            name, namespace = entry["name"], entry["namespace"]
            if namespace != self.cfg.namespace or not _NODE_ID.match(name):
                continue
            actor = ray.get_actor(name, namespace=namespace)
            try:
                ray.get(actor.info.remote(), timeout=self.cfg.connect_timeout_s)
            except Exception as e:  # dying, or stuck: not one to attach to
                logger.warning("not attaching to %s: %s: %s", name, type(e).__name__, e)
                continue
            found[name] = actor
        return found

    def _attach(self, running: dict[str, Any]) -> None:
        settings: NodeSettings = ray.get(next(iter(running.values())).settings.remote())
        self._secret = settings.node.transfer.secret
        self.client.use_secret(self._secret)
        adopted = dataclasses.replace(settings.engine, num_threads=self.engine_cfg.num_threads)
        if adopted.page_size != self.engine_cfg.page_size:  # the coordinator mirrors by pages
            raise ValueError(
                f"the running nodes use page size {adopted.page_size}, not "
                f"{self.engine_cfg.page_size}: start with --page-size {adopted.page_size}"
            )
        if adopted != self.engine_cfg:
            logger.warning("attached nodes run %s; new nodes will too", adopted)
        self.engine_cfg = adopted
        infos = ray.get([a.attach.remote(self.client.addr) for a in running.values()])
        for node_id, info in zip(running, infos):
            self.actors[node_id] = running[node_id]
            match = _NODE_ID.match(node_id)
            assert match is not None  # _find_running kept only these
            self.launched[node_id] = LaunchedNode(info.role, int(match[2]))
            self.client.register_node(info, attached=True)
            self.attached.append(node_id)
        for role in ROLES:
            indexes = [node.index for n in running if (node := self.launched[n]).role == role]
            self._ids[role] = itertools.count(max(indexes, default=-1) + 1)
            self.target[role] = max(self.target[role], len(indexes))
        logger.warning("attached to %d running nodes: %s", len(running), sorted(running))

    # -- pools ------------------------------------------------------------------------------

    def nodes_of(self, role: str) -> list[str]:
        """Registered nodes of ``role`` that are not draining."""
        nodes = self.client.nodes
        return [n for n, i in nodes.items() if i.role == role and n not in self.draining]

    def is_pending(self, role: str) -> bool:
        """A node of ``role`` is starting or draining (a scale is under way)."""
        return role in self.starting.values() or role in self.draining.values()

    def scale(self, **targets: int) -> None:
        """Set pool targets (``prefill=`` >= 0, ``decode=`` >= 1); nodes start or drain in the
        background. Call on the client's event loop."""
        for role, n in targets.items():
            if role not in ROLES or n < MIN_POOL[role]:
                raise ValueError(f"pool sizes must be >= {MIN_POOL} for {ROLES}, got {role}={n}")
        self.target.update(targets)
        self._reconcile()

    def capacity(self, role: str, num_other: int) -> Capacity:
        """How many ``role`` nodes the Ray cluster can hold beside ``num_other`` nodes of the
        other pool (``pd.cluster.placement``). Blocking (it asks Ray): not on the event loop."""
        other = next(r for r in ROLES if r != role)
        memory = self._node_memory_bytes()
        return pool_capacity(
            role,
            node_demand(self._gpus, self.cfg.resources(role), memory),
            other,
            node_demand(self._gpus, self.cfg.resources(other), memory),
            num_other,
            ray_totals(is_local=self.cfg.address is None),
            ray_autoscaler_max(),
        )

    def _node_memory_bytes(self) -> float:
        """What a CPU node takes in memory: the largest resident size a node reports, or
        before any has, its checkpoint's weight files."""
        measured = max((s.rss_bytes for s in self.client.node_stats.values()), default=0)
        if measured:
            return float(measured)
        model_dir = resolve_model(self.engine_cfg.model)
        return float(sum(p.stat().st_size for p in model_dir.glob("*.safetensors")))

    def drain(self, node_id: str) -> None:
        """Drain ``node_id`` and remove it; its pool's target drops by one. Call on the
        client's event loop."""
        info = self.client.nodes.get(node_id)
        if info is None or node_id in self.draining:
            raise KeyError(f"no ready node {node_id!r}")
        if self.target[info.role] <= MIN_POOL[info.role]:
            keeps = MIN_POOL[info.role]
            raise ValueError(f"{node_id} is the last {info.role} node: the pool keeps {keeps}")
        self.target[info.role] -= 1
        self._begin_drain(node_id)  # before reconciling: it must count as leaving already
        self._reconcile()

    def _sync_decode_only(self) -> None:
        """Requests go to a decode node alone (``Coordinator.decode_only``) while the prefill
        pool has no node: empty by choice (target 0), or growing from empty (its first node
        starts). Not while a dead node's replacement starts: then they wait for it, as the
        operator asked for a prefill pool and a decode node's long prefills would stretch the
        running streams' TPOT."""
        self.client.coordinator.decode_only = (
            not self.nodes_of("prefill") and not self._num_replacing["prefill"]
        )

    def _reconcile(self) -> None:
        self._sync_decode_only()
        if self._stopping:
            return
        for role in ROLES:
            ready = self.nodes_of(role)
            num_starting = sum(r == role for r in self.starting.values())
            surplus = len(ready) + num_starting - self.target[role]
            for _ in range(-surplus):
                # started here, not in the task: a second reconcile before the task's first
                # turn (a scale right after a drain) counts it as starting, not as missing
                started = self._launch(role)
                if started is not None:
                    self._run_task(self._join(role, *started))
            for node_id in self._victims(ready, min(surplus, len(ready))):
                self._begin_drain(node_id)

    def _victims(self, nodes: list[str], n: int) -> list[str]:
        """The ``n`` nodes whose removal loses the least: fewest cached tokens, least busy."""
        stats = self.client.node_stats

        def cost(node_id: str) -> tuple[int, int, int]:
            s = stats.get(node_id)
            busy = s.num_running + s.num_waiting if s is not None else 0
            newest_first = -self.launched[node_id].index
            return (s.num_cached_tokens if s is not None else 0), busy, newest_first

        return sorted(nodes, key=cost)[: max(n, 0)]

    async def _start_node(self, role: str) -> str | None:
        """Start a ``role`` actor and register it once it is up; a failed start is stopped and
        lowers the pool's target."""
        started = self._launch(role)
        return None if started is None else await self._join(role, *started)

    def _launch(self, role: str) -> tuple[str, ray.ObjectRef[NodeInfo]] | None:
        """Start a ``role`` actor (``starting`` from now on); None if Ray refused it, which
        lowers the pool's target."""
        try:
            started = self._start_actor(role)
        except Exception:
            logger.exception("could not start a %s node: the pool's target drops back", role)
            self.target[role] = max(1, self.target[role] - 1)
            return None
        self.client.begin_start(role)  # requests wait for it rather than fail
        return started

    async def _join(self, role: str, node_id: str, ref: ray.ObjectRef[NodeInfo]) -> str | None:
        """Wait for the started ``node_id`` and register it; a failed start is stopped and
        lowers the pool's target."""
        try:
            info = await asyncio.wait_for(ref, self.cfg.ready_timeout_s)
        except Exception:
            logger.exception("could not start %s: the %s pool's target drops back", node_id, role)
            self.target[role] = max(1, self.target[role] - 1)
            self._stop_actor(node_id)
            return None
        finally:
            self.starting.pop(node_id, None)
            self.client.end_start(role)
        self.client.register_node(info)
        if self._num_replacing[role]:
            self._num_replacing[role] -= 1
            self.replacements.append(node_id)
        logger.warning("%s joined (%s pool: %d)", node_id, role, len(self.nodes_of(role)))
        self._reconcile()
        return node_id

    def _begin_drain(self, node_id: str) -> None:
        """Mark ``node_id`` draining at once (``nodes_of`` no longer counts it, so a reconcile
        that runs before it has left chooses no second node), and let it leave in the
        background."""
        self._mark_draining(node_id)
        self._run_task(self._drain(node_id))

    def _mark_draining(self, node_id: str) -> None:
        self.draining[node_id] = self.client.nodes[node_id].role
        self.client.drain_node(node_id)  # the coordinator routes nothing new to it

    async def _drain(self, node_id: str) -> None:
        """Wait until the draining ``node_id`` has finished its requests (or the drain deadline
        passed), then remove it and stop its actor."""
        deadline = time.monotonic() + self.cfg.drain_deadline_s
        try:
            while time.monotonic() < deadline and node_id in self.actors:
                if not self.client.num_routed_to(node_id):
                    try:
                        if await self.actors[node_id].num_unfinished.remote() == 0:
                            break
                    except Exception:  # died meanwhile: the watchdog drops it
                        break
                await asyncio.sleep(0.05)
            self.client.unregister_node(node_id)  # the others close their pair groups to it
            await self._stop_actor_async(node_id)
        finally:
            self.draining.pop(node_id, None)
        logger.warning("%s drained and stopped", node_id)
        self._reconcile()

    # -- node failures and snapshots --------------------------------------------------------

    async def _ping(self, node_id: str) -> None:
        actor = self.actors.get(node_id)
        if actor is None:
            raise RuntimeError("no actor")
        await actor.info.remote()

    async def _resync(self, node_id: str) -> int:
        return await self.actors[node_id].resync_cache.remote()

    def _on_node_failed(self, node_id: str) -> None:
        """Called on the client's event loop when the watchdog finds a node dead."""
        self._stop_actor(node_id)
        if self._stopping:
            return
        role = self.launched[node_id].role
        if self.cfg.replace_dead_nodes:
            self._num_replacing[role] += 1
            logger.warning("starting a %s node in place of %s", role, node_id)
        else:
            self.target[role] = max(1, self.target[role] - 1)
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
        ids = [n for n in self.actors if n in self.client.nodes]
        return dict(zip(ids, ray.get([self.actors[n].check_integrity.remote() for n in ids])))

    async def _grow(self, role: str) -> str | None:
        self.target[role] += 1
        return await self._start_node(role)

    async def _drain_now(self, node_id: str) -> None:
        info = self.client.nodes[node_id]
        self.target[info.role] -= 1
        self._mark_draining(node_id)
        self._sync_decode_only()
        await self._drain(node_id)

    def _wait(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the client's event loop (from another thread) and wait for it."""
        loop = self.client.loop
        if loop is None or not loop.is_running():
            return asyncio.run(coro)
        timeout_s = timeout_s or self.cfg.ready_timeout_s + 30
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)

    # -- internals --------------------------------------------------------------------------

    def _run_task(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

    def _threads(self) -> int | None:
        """torch threads per node: the cluster's setting, else the engine's (``--num-threads``),
        else on CPU nodes the machine's cores split over the larger pool: a prefill and a
        decode node share them, each busy while the other waits more of the time than not (1
        prefill + 1 decode node on 2 cores served the chat load at 1.22 req/s with 2 threads
        each, 0.73 with 1, in two runs of one morning: BENCHMARKS.md, "pd serve's defaults")."""
        if self.cfg.threads_per_node is not None:
            return self.cfg.threads_per_node
        if self._gpus or self.engine_cfg.num_threads:
            return self.engine_cfg.num_threads
        largest = max(self.cfg.num_prefill, self.cfg.num_decode)
        return max(1, (os.cpu_count() or 1) // largest)

    def _node_env(self, role: str) -> dict[str, str]:
        """Environment variables for a ``role`` node's process: a CPU prefill node's OpenMP
        threads spin only briefly (``PREFILL_SPIN_COUNT``), unless the server's environment
        sets OpenMP's waiting itself (which a local cluster's nodes then inherit)."""
        if role != "prefill" or self._gpus or any(name in os.environ for name in _OMP_WAIT_VARS):
            return {}
        return {"GOMP_SPINCOUNT": str(PREFILL_SPIN_COUNT)}

    def _start_actor(self, role: str) -> tuple[str, ray.ObjectRef[NodeInfo]]:
        """Create a ``role`` node's actor; its ``start`` ref resolves to its ``NodeInfo``."""
        node = LaunchedNode(role, next(self._ids[role]))
        node_id = node.node_id
        self.launched[node_id] = node
        options: dict[str, Any] = {"max_concurrency": 4}
        options.update({"num_gpus": self._gpus, "num_cpus": 1} if self._gpus else {"num_cpus": 0})
        if resources := self.cfg.resources(role):
            options["resources"] = resources
        if self.is_detached:  # outlives this server; the next one finds it by name
            options.update(name=node_id, namespace=self.cfg.namespace, lifetime="detached")
        if env := self._node_env(role):
            options["runtime_env"] = {"env_vars": env}
        engine_cfg = dataclasses.replace(self.engine_cfg, num_threads=self._threads())
        node_cfg = NodeConfig(
            node_id=node_id,
            server_addr=self.client.addr,
            host=node_bind_host(self.cfg.address is None),
            debug_checks=envs.PD_DEBUG,
            transfer=dataclasses.replace(self.cfg.transfer, secret=self._secret),
        )
        handle = ray.remote(ACTOR_CLASSES[role]).options(**options).remote(engine_cfg, node_cfg)
        self.actors[node_id] = handle
        self.starting[node_id] = role
        return node_id, handle.start.remote()

    def _stop_actor(self, node_id: str, wait_s: float = 0.0) -> None:
        """Stop ``node_id``'s actor, if it still has one: ask it to shut down and block up to
        ``wait_s`` (0: do not ask), then kill it. On the event loop: ``_stop_actor_async``."""
        if (actor := self.actors.pop(node_id, None)) is None:
            return
        if wait_s > 0:
            with contextlib.suppress(Exception):  # a dead actor is what we want anyway
                ray.get(actor.shutdown.remote(), timeout=wait_s)
        ray.kill(actor)

    async def _stop_actor_async(self, node_id: str) -> None:
        """``_stop_actor(node_id, wait_s=STOP_TIMEOUT_S)`` without blocking the event loop."""
        if (actor := self.actors.pop(node_id, None)) is None:
            return
        with contextlib.suppress(Exception):  # a dead actor is what we want anyway
            await asyncio.wait_for(actor.shutdown.remote(), STOP_TIMEOUT_S)
        ray.kill(actor)
