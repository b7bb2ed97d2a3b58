"""``Cluster``: places prefill and decode nodes as Ray actors and wires them to the server.

Ray is the lifecycle plane only (placement, health, replacing dead nodes, scaling); requests, tokens, cache
events and transfer handshakes never go through Ray. Locally (``address=None``) a Ray instance
is started with the nodes as CPU actors; with ``address="auto"`` (or a Ray address) the nodes
join an existing cluster, one GPU each. The launcher makes the cluster's secret, which every
zmq frame and pair rendezvous is authenticated with, and hands it to the client and (through
Ray, inside ``TransferConfig``) to every node; it never goes on a command line or into a log.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import ray

from pd import envs
from pd.cluster.addresses import choose_addrs, cluster_node_ip, node_bind_host
from pd.cluster.client import ClusterClient
from pd.config import EngineConfig
from pd.coordinator import Coordinator, CoordinatorConfig
from pd.messages import NodeInfo
from pd.node import NodeConfig
from transfer import TransferConfig
from transfer.auth import new_secret

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterConfig:
    num_prefill: int = 1
    num_decode: int = 1
    address: str | None = None  # None: start a local Ray instance; "auto": join a running one
    # where the server's PULL socket binds: an address, 0.0.0.0 (all interfaces) or "auto"
    # (this machine's Ray IP); nodes are always told a routable one (pd.cluster.addresses)
    host: str = "127.0.0.1"
    threads_per_node: int | None = None  # None: the machine's cores split over the nodes (CPU)
    ready_timeout_s: float = 300.0
    replace_dead_nodes: bool = True  # start a new node of the same role when one dies

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(
                f"need at least one prefill and one decode node, got {self.num_prefill} and {self.num_decode}"
            )


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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
            secret=self._secret,
            ping=self._ping,
            on_node_failed=self._on_node_failed,
        )
        self.actors: dict[str, Any] = {}
        self._ids = {"prefill": itertools.count(), "decode": itertools.count()}
        self._on_gpu = False
        self._stopping = False
        self.replacements: list[str] = []  # node ids started in place of dead ones
        self._tasks: set[asyncio.Task[None]] = set()

    # -- start / stop -----------------------------------------------------------------------

    def start(self) -> None:
        if not ray.is_initialized():
            if self.cfg.address is None:
                total = self.cfg.num_prefill + self.cfg.num_decode
                ray.init(
                    num_cpus=max(2, total),
                    include_dashboard=False,
                    object_store_memory=80 * 2**20,
                    log_to_driver=True,
                )
            else:
                ray.init(address=self.cfg.address)
        self._on_gpu = self.cfg.address is not None and ray.cluster_resources().get("GPU", 0) > 0
        node_ip = cluster_node_ip(self.cfg.address is None, ray.util.get_node_ip_address())
        addrs = choose_addrs(self.cfg.host, node_ip)
        port = _free_port(addrs.bind_host)
        self.client.listen_at(addrs.bind(port), addrs.endpoint(port))
        refs = [self._spawn("prefill") for _ in range(self.cfg.num_prefill)]
        refs += [self._spawn("decode") for _ in range(self.cfg.num_decode)]
        for info in ray.get(refs, timeout=self.cfg.ready_timeout_s):
            self.client.add_node(info)

    def shutdown(self) -> None:
        self._stopping = True
        for node_id in list(self.actors):
            self._kill(node_id)

    # -- scaling ----------------------------------------------------------------------------

    def add_node(self, role: str) -> str:
        """Start one more node of ``role`` and register it with the coordinator."""
        info = ray.get(self._spawn(role), timeout=self.cfg.ready_timeout_s)
        self.client.add_node(info)
        return info.node_id

    def remove_node(self, node_id: str, timeout_s: float = 120.0) -> None:
        """Drain a node (no new requests, in-flight ones finish), then stop its actor."""
        actor = self.actors[node_id]
        self.client.drain_node(node_id)  # the coordinator routes nothing new to it
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and (
            self.client.num_routed_to(node_id) or ray.get(actor.num_unfinished.remote())
        ):
            time.sleep(0.05)
        self.client.remove_node(node_id)
        self._kill(node_id)

    def check_integrity(self) -> dict[str, dict[str, int]]:
        """Every node's slot accounting (asserts inside each node)."""
        ids = list(self.actors)
        return dict(zip(ids, ray.get([self.actors[n].check_integrity.remote() for n in ids])))

    async def _ping(self, node_id: str) -> None:
        actor = self.actors.get(node_id)
        if actor is None:
            raise RuntimeError("no actor")
        await actor.info.remote()

    def _on_node_failed(self, node_id: str) -> None:
        """Called on the client's event loop when the watchdog finds a node dead."""
        actor = self.actors.pop(node_id, None)
        if actor is not None:
            ray.kill(actor, no_restart=True)
        if not self.cfg.replace_dead_nodes or self._stopping:
            return
        role = node_id.rsplit("-", 1)[0]

        async def replace() -> None:
            try:
                info = await asyncio.wait_for(self._spawn(role), self.cfg.ready_timeout_s)
            except Exception:
                logger.exception("could not start a %s node in place of %s", role, node_id)
                return
            self.client.add_node(info)
            self.replacements.append(info.node_id)
            logger.warning("started %s in place of %s", info.node_id, node_id)

        task = asyncio.get_running_loop().create_task(replace())
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

    # -- internals --------------------------------------------------------------------------

    def _threads(self) -> int | None:
        if self._on_gpu:
            return self.engine_cfg.num_threads
        if self.cfg.threads_per_node is not None:
            return self.cfg.threads_per_node
        total = self.cfg.num_prefill + self.cfg.num_decode
        return max(1, (os.cpu_count() or 1) // total)

    def _spawn(self, role: str) -> ray.ObjectRef[NodeInfo]:
        from decode.node import DecodeNode
        from prefill.node import PrefillNode

        node_id = f"{role}-{next(self._ids[role])}"
        cls = PrefillNode if role == "prefill" else DecodeNode
        options: dict[str, Any] = {"name": None, "max_concurrency": 4}
        options.update({"num_gpus": 1, "num_cpus": 1} if self._on_gpu else {"num_cpus": 0})
        engine_cfg = dataclasses.replace(self.engine_cfg, num_threads=self._threads())
        node_cfg = NodeConfig(
            node_id=node_id,
            server_addr=self.client.addr,
            host=node_bind_host(self.cfg.address is None),
            debug_checks=envs.PD_DEBUG,
            transfer=TransferConfig(secret=self._secret),
        )
        actor = ray.remote(cls).options(**{k: v for k, v in options.items() if v is not None})
        handle = actor.remote(engine_cfg, node_cfg)
        self.actors[node_id] = handle
        return handle.start.remote()

    def _kill(self, node_id: str) -> None:
        actor = self.actors.pop(node_id)
        try:
            ray.get(actor.shutdown.remote(), timeout=15)
        except Exception:  # a dead actor is what we want anyway
            pass
        ray.kill(actor)
