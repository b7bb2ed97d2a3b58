"""What a node is started with (frozen; the launcher hands each node its copy)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from pd.executor.config import EngineConfig
from transfer.state import TransferConfig


@dataclass(frozen=True)
class NodeConfig:
    node_id: str
    server_addr: str  # the server's PULL socket this node pushes to
    # where this node's sockets bind ("auto": the machine's cluster IP; see pd.core.addresses)
    host: str = "127.0.0.1"
    # the node's machine's cluster IP and Ray node, filled in by whoever placed the node
    # (pd.fleet.node_actor, from Ray, inside the node's process); "" outside Ray
    node_ip: str = ""
    ray_node_id: str = ""
    # pd nodes that may share this node's machine (the launcher counts them): the host tier's
    # default takes its share of the machine's memory (pd.executor.host_pool)
    machine_nodes: int = 1
    stats_interval_s: float = 0.2
    idle_poll_ms: int = 5
    # a message the server's socket cannot take for this long is dropped (no server reads:
    # it exited and a new one will attach), and so is every later one until a send succeeds
    server_send_timeout_ms: int = 2000
    debug_checks: bool = False  # check_integrity() whenever the node goes idle
    transfer: TransferConfig = field(default_factory=TransferConfig)  # holds the cluster secret


class NodeSettings(NamedTuple):
    engine: EngineConfig
    node: NodeConfig
