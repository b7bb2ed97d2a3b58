"""Which address each internal socket binds and which it advertises.

Pure functions of the configured bind host and the Ray node IP (the address other members
reach this machine at: loopback for a local Ray instance, whose members all share one machine):

    | bind host              | binds         | advertises    |
    |------------------------|---------------|---------------|
    | "auto"                 | node IP       | node IP       |
    | 0.0.0.0 (any wildcard) | all (0.0.0.0) | node IP       |
    | loopback, node IP not  | node IP       | node IP       |
    | anything else          | itself        | itself        |

So nothing advertises a wildcard, and nothing advertises loopback unless the node IP is
loopback (one machine): on a multi-machine cluster a loopback address would be each reader's
own machine.
"""

from __future__ import annotations

from typing import NamedTuple

from transfer.endpoint import check_host, is_loopback, is_wildcard

LOCAL_NODE_IP = "127.0.0.1"  # the node IP of a local Ray instance: every member is here


class SocketAddrs(NamedTuple):
    bind_host: str  # what the socket binds ("0.0.0.0": every interface)
    host: str  # what the socket advertises: what others dial

    def bind(self, port: int) -> str:
        return f"tcp://{self.bind_host}:{port}"

    def endpoint(self, port: int) -> str:
        return f"tcp://{self.host}:{port}"


def choose_addrs(bind_host: str, node_ip: str) -> SocketAddrs:
    """Bind and advertised host of a socket on the machine whose Ray node IP is ``node_ip``."""
    check_host(node_ip)
    if bind_host == "auto":
        return SocketAddrs(node_ip, node_ip)
    if is_wildcard(bind_host):
        return SocketAddrs("0.0.0.0", node_ip)
    if is_loopback(bind_host) and not is_loopback(node_ip):
        return SocketAddrs(node_ip, node_ip)  # others could never dial our loopback
    return SocketAddrs(check_host(bind_host), bind_host)


def cluster_node_ip(is_local: bool, ray_node_ip: str) -> str:
    """The node IP the addresses of a cluster's members are chosen with."""
    return LOCAL_NODE_IP if is_local else ray_node_ip


def node_bind_host(is_local: bool) -> str:
    """The bind host the launcher hands each node: loopback on a local instance, else the
    node's own Ray IP, which only the node's actor knows ("auto")."""
    return LOCAL_NODE_IP if is_local else "auto"


def node_addrs(bind_host: str, node_ip: str) -> SocketAddrs:
    """A node's sockets. A concrete bind host is the node's own address; "auto" and wildcards
    need ``node_ip``, the node's machine's cluster IP, which whoever placed the node looked up
    (``pd.fleet.node_actor``: Ray's, inside the node's actor)."""
    if bind_host == "auto" or is_wildcard(bind_host):
        if not node_ip:
            raise ValueError(f"bind host {bind_host!r} needs the node's cluster IP (node_ip)")
        return choose_addrs(bind_host, node_ip)
    return choose_addrs(bind_host, bind_host)
