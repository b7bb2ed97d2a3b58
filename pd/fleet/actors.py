"""``NodeActors``: the nodes' Ray actors, every Ray call the launcher makes.

Ray is the lifecycle plane only: this places a node (its resources, its environment, its
threads, its ``NodeConfig``), stops it, pings it for the watchdog, asks it for its cache
snapshot, finds the nodes running in the cluster's namespace and attaches to them, and checks
their accounting. Locally (``address=None``) the nodes are CPU actors of a private Ray instance;
with an address they are detached actors named by their node id in ``namespace``, one GPU each
when the cluster has GPUs. Each node's actor is kept on its ``PoolNode`` until it is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from typing import Any

import ray

from pd.core import envs
from pd.core.addresses import cluster_node_ip, node_bind_host
from pd.core.messages import NodeInfo
from pd.executor.config import EngineConfig
from pd.fleet.config import ClusterConfig, init_ray
from pd.fleet.node_actor import ACTOR_CLASSES
from pd.fleet.pools import PoolNode, Pools, parse_node_id
from pd.node import NodeConfig, NodeSettings

logger = logging.getLogger(__name__)
STOP_TIMEOUT_S = 15.0  # a node's own shutdown, before its actor is killed
# Iterations an idle OpenMP thread of a CPU prefill node spins before it sleeps (libgomp's own
# count for a process with more threads than cores): the CPU nodes share the machine's cores, and
# a prefill node spinning between its parallel regions holds cores a decoding node needs; decode
# nodes run without pause and keep the default (docs/bench/history.md, "OpenMP threads that share
# the cores").
PREFILL_SPIN_COUNT = 1000
_OMP_WAIT_VARS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


class NodeActors:
    def __init__(self, cfg: ClusterConfig, pools: Pools) -> None:
        self.cfg = cfg
        self._pools = pools  # whose nodes hold the actors
        self.gpus = 0.0  # each node's (ClusterConfig.node_gpus, resolved in connect())

    @property
    def is_detached(self) -> bool:
        """Nodes are detached, named actors in ``namespace`` (a shared Ray cluster)."""
        return self.cfg.address is not None

    def connect(self) -> str:
        """Join the Ray cluster (or start the private instance) and resolve each node's GPUs;
        returns this machine's IP for the nodes to reach."""
        if not ray.is_initialized():
            init_ray(self.cfg)
        has_gpus = self.is_detached and ray.cluster_resources().get("GPU", 0) > 0
        self.gpus = self.cfg.node_gpus if self.cfg.node_gpus is not None else float(has_gpus)
        return cluster_node_ip(self.cfg.address is None, ray.util.get_node_ip_address())

    def start(
        self, node: PoolNode, engine_cfg: EngineConfig, server_addr: str, secret: bytes
    ) -> ray.ObjectRef[NodeInfo]:
        """Create ``node``'s actor; the returned ref resolves to its ``NodeInfo`` once it is
        up."""
        role, node_id = node.role, node.node_id
        gpus = self.gpus_of(role, engine_cfg)
        tp = self.cfg.tensor_parallel_size(role, engine_cfg.tensor_parallel_size)
        engine_cfg = dataclasses.replace(engine_cfg, tensor_parallel_size=tp)
        options: dict[str, Any] = {"max_concurrency": 4}
        options.update({"num_gpus": gpus, "num_cpus": 1} if gpus else {"num_cpus": 0})
        if resources := self.cfg.resources(role):
            options["resources"] = resources
        if self.is_detached:  # outlives this server; the next one finds it by name
            options.update(name=node_id, namespace=self.cfg.namespace, lifetime="detached")
        if env := self._env(role):
            options["runtime_env"] = {"env_vars": env}
        engine_cfg = dataclasses.replace(engine_cfg, num_threads=self.threads(engine_cfg))
        node_cfg = NodeConfig(
            node_id=node_id,
            server_addr=server_addr,
            host=node_bind_host(self.cfg.address is None),
            debug_checks=envs.PD_DEBUG,
            transfer=dataclasses.replace(self.cfg.transfer, secret=secret),
            machine_nodes=self.machine_nodes(),
        )
        node.actor = ray.remote(ACTOR_CLASSES[role]).options(**options).remote(engine_cfg, node_cfg)
        return node.actor.start.remote()

    def wait_started(self, refs: list[ray.ObjectRef[NodeInfo]]) -> list[NodeInfo]:
        """What ``start``'s refs resolve to, blocking up to ``ready_timeout_s``."""
        return ray.get(refs, timeout=self.cfg.ready_timeout_s)

    def stop(self, node_id: str, wait_s: float = 0.0) -> None:
        """Stop ``node_id``'s actor, if it still has one: ask it to shut down and block up to
        ``wait_s`` (0: do not ask), then kill it. On the event loop: ``stop_async``."""
        node = self._pools[node_id]
        actor, node.actor = node.actor, None
        if actor is None:
            return
        if wait_s > 0:
            with contextlib.suppress(Exception):  # a dead actor is what we want anyway
                ray.get(actor.shutdown.remote(), timeout=wait_s)
        ray.kill(actor)

    async def stop_async(self, node_id: str) -> None:
        """``stop(node_id, wait_s=STOP_TIMEOUT_S)`` without blocking the event loop."""
        node = self._pools[node_id]
        actor, node.actor = node.actor, None
        if actor is None:
            return
        with contextlib.suppress(Exception):  # a dead actor is what we want anyway
            await asyncio.wait_for(actor.shutdown.remote(), STOP_TIMEOUT_S)
        ray.kill(actor)

    def running(self) -> list[str]:
        """The nodes whose actors are not stopped."""
        return [n.node_id for n in self._pools.nodes() if n.actor is not None]

    async def ping(self, node_id: str) -> None:
        """Raises when the node's actor is gone (the watchdog's ping)."""
        actor = self._pools[node_id].actor
        if actor is None:
            raise RuntimeError("no actor")
        await actor.info.remote()

    async def resync(self, node_id: str) -> int:
        """Ask the node for its cache snapshot; how many events it sent."""
        return await self._pools[node_id].actor.resync_cache.remote()

    async def num_unfinished(self, node_id: str) -> int:
        """The node's requests not finished yet (raises when its actor is gone)."""
        return await self._pools[node_id].actor.num_unfinished.remote()

    def check_integrity(self, node_ids: list[str]) -> dict[str, dict[str, int]]:
        """Each node's slot and resource accounting (asserts inside each node)."""
        refs = [self._pools[n].actor.check_integrity.remote() for n in node_ids]
        return dict(zip(node_ids, ray.get(refs)))

    def find_running(self) -> dict[str, Any]:
        """The live pd nodes' actors in this cluster's namespace, by node id."""
        found: dict[str, Any] = {}
        for entry in ray.util.list_named_actors(all_namespaces=True):
            name, namespace = entry["name"], entry["namespace"]
            if namespace != self.cfg.namespace or parse_node_id(name) is None:
                continue
            actor = ray.get_actor(name, namespace=namespace)
            try:
                ray.get(actor.info.remote(), timeout=self.cfg.connect_timeout_s)
            except Exception as e:  # dying, or stuck: not one to attach to
                logger.warning("not attaching to %s: %s: %s", name, type(e).__name__, e)
                continue
            found[name] = actor
        return found

    @staticmethod
    def settings_of(running: dict[str, Any]) -> NodeSettings:
        """The settings the ``running`` actors share (one is asked)."""
        return ray.get(next(iter(running.values())).settings.remote())

    @staticmethod
    def attach(running: dict[str, Any], server_addr: str) -> list[NodeInfo]:
        """Each ``running`` node's ``NodeInfo`` once it reports to ``server_addr`` (its old
        requests aborted)."""
        return ray.get([a.attach.remote(server_addr) for a in running.values()])

    def gpus_of(self, role: str, engine_cfg: EngineConfig) -> float:
        """GPUs a ``role`` node asks Ray for: a node of N ranks takes N of one machine (one
        actor asks for them all, so Ray places them together)."""
        return self.gpus * self.cfg.tensor_parallel_size(role, engine_cfg.tensor_parallel_size)

    def threads(self, engine_cfg: EngineConfig) -> int | None:
        """torch threads per node: the cluster's setting, else the engine's (``--num-threads``),
        else on CPU nodes the machine's cores split over the larger pool: a prefill and a
        decode node share them, each busy while the other mostly waits (docs/bench/history.md,
        "pd serve's defaults on a CPU")."""
        if self.cfg.threads_per_node is not None:
            return self.cfg.threads_per_node
        if self.gpus or engine_cfg.num_threads:
            return engine_cfg.num_threads
        largest = max(self.cfg.num_prefill, self.cfg.num_decode)
        return max(1, (os.cpu_count() or 1) // largest)

    def machine_nodes(self) -> int:
        """How many pd nodes may share a node's machine (its host tier's default takes its
        share of the machine's memory): on the private local instance, the cluster's (its
        pools' sizes now); on a Ray cluster, with GPUs, as many as the Ray node with the most
        GPUs can hold, else the cluster's (a CPU node asks Ray for no CPU: any number of them
        may land on one machine). A node started later counts the sizes then: the nodes before
        it keep their share (its pages resident only as used)."""
        num_nodes = max(1, sum(self._pools.target.values()))
        if not (self.is_detached and self.gpus):
            return num_nodes
        alive = [n["Resources"].get("GPU", 0.0) for n in ray.nodes() if n.get("Alive")]
        return max(1, min(num_nodes, int(max(alive, default=0.0) // self.gpus)))

    def _env(self, role: str) -> dict[str, str]:
        """Environment variables for a ``role`` node's process: a CPU prefill node's OpenMP
        threads spin only briefly (``PREFILL_SPIN_COUNT``), unless the server's environment
        sets OpenMP's waiting itself (which a local cluster's nodes then inherit)."""
        if role != "prefill" or self.gpus or any(name in os.environ for name in _OMP_WAIT_VARS):
            return {}
        return {"GOMP_SPINCOUNT": str(PREFILL_SPIN_COUNT)}
