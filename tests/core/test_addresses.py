"""Which addresses the server and nodes bind and advertise (pure functions, no traffic)."""

from __future__ import annotations

import itertools

import pytest

from pd.core.addresses import (
    SocketAddrs,
    choose_addrs,
    cluster_node_ip,
    node_addrs,
    node_bind_host,
)
from pd.core.messages import PrefillReqMsg
from pd.core.sampling_params import SamplingParams
from transfer.endpoint import is_loopback, parse_endpoint

BIND_HOSTS = ["auto", "0.0.0.0", "*", "::", "127.0.0.1", "127.0.1.1", "localhost", "10.1.2.3"]
RAY_IPS = ["127.0.0.1", "10.0.0.7", "192.168.5.20"]


def _plan(bind_host: str, ray_ip: str, is_local: bool) -> tuple[SocketAddrs, list[SocketAddrs]]:
    """What the launcher and its nodes would choose: the server's addresses, then each
    node's (nodes on this machine and on others)."""
    server = choose_addrs(bind_host, cluster_node_ip(is_local, ray_ip))
    node_ips = [ray_ip] if is_local else [ray_ip, "10.0.0.8", "10.9.9.9"]
    nodes = [node_addrs(node_bind_host(is_local), ip) for ip in node_ips]
    return server, nodes


@pytest.mark.parametrize(
    "bind_host, ray_ip, is_local",
    [(b, r, loc) for b, r, loc in itertools.product(BIND_HOSTS, RAY_IPS, [True, False])],
)
def test_nothing_advertised_is_a_wildcard_or_a_loopback_others_cannot_reach(
    bind_host: str, ray_ip: str, is_local: bool
) -> None:
    server, nodes = _plan(bind_host, ray_ip, is_local)
    advertised = [server.endpoint(5000)] + [n.endpoint(6000) for n in nodes]
    for endpoint in advertised:
        host, _ = parse_endpoint(endpoint)  # raises on a wildcard
        if not is_local and not is_loopback(ray_ip):
            assert not is_loopback(host), (bind_host, ray_ip, endpoint)
    for n in nodes:  # internal ports bind the node's cluster IP, nothing wider
        assert n.bind_host == n.host


@pytest.mark.parametrize(
    "bind_host, node_ip, want",
    [
        ("0.0.0.0", "10.0.0.7", ("0.0.0.0", "10.0.0.7")),  # README: --address auto --host 0.0.0.0
        ("0.0.0.0", "127.0.0.1", ("0.0.0.0", "127.0.0.1")),  # a local instance
        ("auto", "10.0.0.7", ("10.0.0.7", "10.0.0.7")),
        ("127.0.0.1", "10.0.0.7", ("10.0.0.7", "10.0.0.7")),  # loopback unreachable from others
        ("127.0.0.1", "127.0.0.1", ("127.0.0.1", "127.0.0.1")),
        ("10.1.2.3", "10.0.0.7", ("10.1.2.3", "10.1.2.3")),  # an interface the user chose
        ("head.example", "10.0.0.7", ("head.example", "head.example")),
    ],
)
def test_bind_and_advertised_hosts(bind_host: str, node_ip: str, want: tuple[str, str]) -> None:
    assert choose_addrs(bind_host, node_ip) == want


def test_the_node_ip_counts_only_for_auto_and_wildcards() -> None:
    assert node_addrs("127.0.0.1", "10.9.9.9") == ("127.0.0.1", "127.0.0.1")
    assert node_addrs("127.0.0.1", "") == ("127.0.0.1", "127.0.0.1")
    assert node_addrs("0.0.0.0", "10.0.0.7") == ("0.0.0.0", "10.0.0.7")
    with pytest.raises(ValueError, match="needs the node's cluster IP"):
        node_addrs("auto", "")  # whoever placed the node must say where it is
    with pytest.raises(ValueError, match="not a host to dial"):
        choose_addrs("auto", "0.0.0.0")  # a broken Ray IP is an error, not an address


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://0.0.0.0:5000", "tcp://*:5000", "tcp://10.0.0.1:0", "tcp://10.0.0.1:70000",
     "ipc:///tmp/x", "tcp://10.0.0.1", "tcp://bad host:1", "tcp://[::1]:5000", "x" * 300],
)  # fmt: skip
def test_an_address_a_node_would_dial_must_be_tcp_host_port(endpoint: str) -> None:
    with pytest.raises(ValueError):
        parse_endpoint(endpoint)
    with pytest.raises(ValueError):  # a server bug cannot make a prefill node dial it
        PrefillReqMsg(
            request_id="r",
            prompt_ids=[1],
            sampling=SamplingParams(),
            namespace="",
            decode_node="decode-0",
            decode_addr="tcp://10.0.0.1:1",
            decode_transfer_addr=endpoint,
        )
