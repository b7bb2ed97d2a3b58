"""``ClusterConfig`` and the Ray connection: a private local instance, or a running cluster that
must answer within seconds."""

from __future__ import annotations

import random
import socket
from dataclasses import dataclass, field
from pathlib import Path

from pd.cluster.client_config import MIN_POOL, ROLES, ClientConfig
from pd.core.options import json_numbers, option
from transfer.state import TransferConfig


@dataclass(frozen=True)
class ClusterConfig:
    """The pools and their Ray placement. The ``option`` fields are ``pd serve``'s flags (group
    "cluster and Ray"), in this order."""

    # pd serve's default is ``pd.cli.serve.prefill_pool_size``'s
    num_prefill: int = option(
        1,
        "prefill nodes; 0: the decode nodes prefill every prompt. Default: 0 on one CPU "
        "machine (no --address, --node-gpus or --autoscale: it would share the cores), else 1",
        flag="prefill",
    )
    num_decode: int = option(1, "decode nodes", flag="decode")
    address: str | None = option(None, "join a running Ray cluster ('auto'); default: start one")
    prefill_resources: dict[str, float] = option(
        {},
        "Ray custom resources each prefill node asks for, e.g. '{\"prefill\": 1}'",
        parse=json_numbers,
    )
    decode_resources: dict[str, float] = option(
        {},
        "Ray custom resources each decode node asks for, e.g. '{\"decode\": 1}'",
        parse=json_numbers,
    )
    node_gpus: float | None = option(
        None,
        "GPUs each node asks for (default: 1 if the Ray cluster has GPUs, else 0); 1 "
        "where Ray's autoscaler adds GPU machines for nodes that wait",
    )
    prefill_tensor_parallel_size: int | None = option(
        None, "ranks of each prefill node (a GPU each); default: --tensor-parallel-size"
    )
    decode_tensor_parallel_size: int | None = option(
        None, "ranks of each decode node (a GPU each); default: --tensor-parallel-size"
    )
    namespace: str = option("pd", "with --address: the Ray namespace of the nodes")
    keep_nodes: bool = option(
        True,
        "with --address: leave the nodes running when pd serve exits (the next one "
        "attaches to them and their caches)",
    )
    # where the server's PULL socket binds: an address, 0.0.0.0 (all interfaces) or "auto"
    # (this machine's Ray IP); nodes are always told a routable one (pd.core.addresses)
    host: str = "127.0.0.1"
    # None: --num-threads, else (CPU) the machine's cores split over the larger pool's nodes
    threads_per_node: int | None = None
    ready_timeout_s: float = 300.0
    replace_dead_nodes: bool = True  # start a new node of the same role when one dies
    connect_timeout_s: float = 5.0  # with an address: the cluster must answer within this
    drain_timeout_s: float | None = None  # a draining node's requests; None: request_timeout_s
    client: ClientConfig = field(default_factory=ClientConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)  # every node's

    def __post_init__(self) -> None:
        if self.num_prefill < MIN_POOL["prefill"] or self.num_decode < MIN_POOL["decode"]:
            raise ValueError(
                f"need at least {MIN_POOL['prefill']} prefill and {MIN_POOL['decode']} decode "
                f"node(s), got {self.num_prefill} and {self.num_decode}"
            )
        num_nodes = self.num_prefill + self.num_decode
        if num_nodes >= self.transfer.max_conns:  # one each to the server's socket, and the server
            raise ValueError(
                f"{num_nodes} nodes need transfer max_conns > {num_nodes} (each internal socket "
                f"takes one connection per node, and the server's), got {self.transfer.max_conns}"
            )
        for size in (self.prefill_tensor_parallel_size, self.decode_tensor_parallel_size):
            if size is not None and size < 1:
                raise ValueError(f"a pool's tensor parallel size must be >= 1, got {size}")
        if self.node_gpus is not None and self.node_gpus < 0:
            raise ValueError(f"node_gpus must be >= 0, got {self.node_gpus}")
        for role in ROLES:
            for name, amount in self.resources(role).items():
                if not name or name in ("CPU", "GPU", "memory") or not amount > 0:
                    raise ValueError(
                        f"{role} resources must be custom resource names with amounts > 0, "
                        f"got {name!r}: {amount}"
                    )

    def resources(self, role: str) -> dict[str, float]:
        return self.prefill_resources if role == "prefill" else self.decode_resources

    def tensor_parallel_size(self, role: str, default: int) -> int:
        """Ranks of each ``role`` node (``default``: the engine's)."""
        size = (
            self.prefill_tensor_parallel_size
            if role == "prefill"
            else self.decode_tensor_parallel_size
        )
        return default if size is None else size

    @property
    def drain_deadline_s(self) -> float:
        return self.drain_timeout_s or self.client.request_timeout_s


# Ray's worker processes listen on 10002-19999 by default (``ray start --max-worker-port``)
_ABOVE_RAY_WORKERS = 20000


def free_port(host: str, rng: random.Random | None = None) -> int:
    """A port free on ``host`` now, for the server's PULL socket, which binds it only once the
    nodes have started (seconds to minutes later): it is picked below the kernel's ephemeral
    range, where the hundreds of ports that the nodes, Ray and gloo bind meanwhile (port 0)
    never land, and above Ray's worker ports. Once one of those took the port picked from
    the ephemeral range (``Address already in use`` at start-up, in a test run). Falls back
    to an ephemeral port where that range is empty or taken."""
    rng = rng or random.Random()
    low = _ephemeral_ports()[0]
    for _ in range(64 if low > _ABOVE_RAY_WORKERS else 0):
        port = rng.randrange(_ABOVE_RAY_WORKERS, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports bound as 0 (Linux; elsewhere IANA's 49152-65535)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


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
    to be reachable first; "auto" is handed to Ray as it is, which then also finds the
    machine's auth token (``~/.ray/auth_token``): Ray never does for an explicit address."""
    import ray  # here: ``pd.cli`` reads this module's flags, and ``pd generate`` needs no Ray

    if cfg.address is None:
        ray.init(
            address="local",
            num_cpus=max(2, cfg.num_prefill + cfg.num_decode),
            include_dashboard=False,
            object_store_memory=80 * 2**20,
            log_to_driver=True,
        )
    else:
        address = reachable_address(cfg.address, cfg.connect_timeout_s)
        ray.init(address="auto" if cfg.address == "auto" else address, namespace=cfg.namespace)
