"""``Cluster``: places prefill and decode nodes as Ray actors and wires them to the server.

Ray is the lifecycle plane only (placement, health, replacing dead nodes, scaling); requests, tokens, cache
events and transfer handshakes never go through Ray. Locally (``address=None``) a private Ray
instance is always started, with the nodes as CPU actors, whatever other Ray cluster (live, or
dead with its record left behind) the machine has; with ``address="auto"`` (or a Ray address)
the nodes join that cluster, one GPU each, and an unreachable one is an error within seconds.
The launcher makes the cluster's secret, which every zmq frame and pair rendezvous is
authenticated with, and hands it to the client and (through Ray, inside ``TransferConfig``) to
every node; it never goes on a command line or into a log.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from pd import envs
from pd.cluster.addresses import choose_addrs, cluster_node_ip, node_bind_host
from pd.cluster.client import ClientConfig, ClusterClient
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
    connect_timeout_s: float = 5.0  # with an address: the cluster must answer within this
    client: ClientConfig = field(default_factory=ClientConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)  # every node's

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(
                f"need at least one prefill and one decode node, got {self.num_prefill} and {self.num_decode}"
            )


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def reachable_address(address: str, timeout_s: float) -> str:
    """The GCS address that ``address`` names ("auto": RAY_ADDRESS, else the machine's latest
    ``ray start``, as Ray resolves it), checked to accept a connection within ``timeout_s``.
    ConnectionError with the address otherwise: ``ray.init`` itself would retry for minutes."""
    from ray._private.services import canonicalize_bootstrap_address

    if "://" in address:  # a Ray client address: check its host:port, hand it over as it is
        target: str | None = address.split("://", 1)[1]
    else:
        target = canonicalize_bootstrap_address(address)  # ConnectionError if none is found
    if not target:
        raise ConnectionError(f"no Ray cluster found for --address {address}")
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as e:
        raise ConnectionError(
            f"cannot reach the Ray cluster at {target} (--address {address}) within "
            f"{timeout_s} s: {e}"
        ) from e
    return address if "://" in address else target


def init_ray(cfg: ClusterConfig) -> None:
    """Without an address, a private local Ray instance: never RAY_ADDRESS, nor the record a
    ``ray start`` cluster (live or dead) left on this machine. With one, that cluster, checked
    to be reachable first."""
    if cfg.address is None:
        ray.init(
            address="local",
            num_cpus=max(2, cfg.num_prefill + cfg.num_decode),
            include_dashboard=False,
            object_store_memory=80 * 2**20,
            log_to_driver=True,
        )
    else:
        ray.init(address=reachable_address(cfg.address, cfg.connect_timeout_s))


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
            init_ray(self.cfg)
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
        self.client.remove_node(node_id)  # the others close their pair groups to it
        self._kill(node_id)

    def check_integrity(self) -> dict[str, dict[str, int]]:
        """Every registered node's slot and resource accounting (asserts inside each node);
        nodes still starting are not waited for."""
        ids = [n for n in self.actors if n in self.client.nodes]
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
        self.client.begin_start(role)  # requests wait for it rather than fail

        async def replace() -> None:
            try:
                info = await asyncio.wait_for(self._spawn(role), self.cfg.ready_timeout_s)
                self.client.add_node(info)
            except Exception:
                logger.exception("could not start a %s node in place of %s", role, node_id)
                return
            finally:
                self.client.end_start(role)
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
            transfer=dataclasses.replace(self.cfg.transfer, secret=self._secret),
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
