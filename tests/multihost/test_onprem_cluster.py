"""pd across hosts for real: ``ray up`` of ``ray_cluster.onprem.yaml`` on hosts in network
namespaces (``pdtools/netns_hosts.py``), ``pd serve`` through ``ray exec`` on the head, and the
network faults of RELIABILITY.md's "Many hosts" table.

One cluster for the module (one ``ray up``, to fit the set in 4 minutes), and the tests run in
file order on it: h1 is the head (``pd serve``), h2 offers {"prefill": 1}, h3 {"decode": 1}; h4
joins later with {"prefill": 2}. pd's heartbeat timeout is 4 s here. Every answer is checked
against the single-host reference (the colocated engine, greedy, the same tiny model).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdtools.netns_hosts import ROOT, Host, NetnsHosts
from pdtools.netns_ray import PORT, OnpremCluster
from tests.cluster import test_faults
from tests.cluster.test_faults import PROMPTS, Load, Outcome, _generate
from tests.multihost.conftest import REPORT

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(240)]
HEARTBEAT_S = 4.0
_PD_NODE = ("ray::PrefillNod", "ray::DecodeNode")  # the nodes' process names (15 characters)
reference = test_faults.reference  # fixture: the colocated engine's greedy tokens for PROMPTS


@dataclass
class Onprem:
    hosts: NetnsHosts
    ray: OnpremCluster
    url: str
    serve: subprocess.Popen[bytes] | None
    head: Host
    prefill_host: Host
    decode_host: Host
    tmp_ray_before: set[str] = field(default_factory=set)

    def host(self, index: int) -> Host:
        return self.hosts.hosts[index - 1]


@pytest.fixture(scope="module")
def onprem(netns_hosts: NetnsHosts, tiny_llama_dir: Path) -> Iterator[Onprem]:
    hosts = netns_hosts
    shutil.copytree(tiny_llama_dir, ROOT / "model")  # the same path on every host
    tmp_ray = Path("/tmp/ray")  # this machine's own Ray sessions (other tests' local instances)
    before = {p.name for p in tmp_ray.iterdir()} if tmp_ray.exists() else set()
    head, prefill_host, decode_host = (hosts.add_host() for _ in range(3))
    # h4 is listed too, but made (booted) only once pd serve runs: it joins late
    workers = {2: {"prefill": 1.0}, 3: {"decode": 1.0}, 4: {"prefill": 2.0}}
    ray = OnpremCluster(hosts, head, workers)
    start = time.monotonic()
    took = ray.up(wait_for=[])  # the head; the workers join while pd serve starts
    flags = f"--model {ROOT / 'model'} --quantization none --compile-buckets off --heartbeat-timeout-s {HEARTBEAT_S} --request-timeout 120 --local-prefill-tokens -1"
    serve = ray.serve(flags, ROOT / "serve.log")
    url = f"http://{head.ip}:{PORT}"
    _until(lambda: _ready(url)[0] == 200, "pd serve ready", 150, serve, ROOT / "serve.log")
    REPORT.append(
        f"ray up (token, then the head up): {took:.1f} s; then pd serve (ray exec) to /ready 200 "
        f"on 2 workers: {time.monotonic() - start - took:.1f} s"
    )
    hosts.add_host()  # h4 boots
    live = Onprem(hosts, ray, url, serve, head, prefill_host, decode_host, before)
    try:
        yield live
    finally:
        if live.serve is not None:
            hosts.stop_launched(live.serve)


# -- looking at the cluster ----------------------------------------------------------------


def _until(
    cond: Callable[[], Any],
    what: str,
    timeout_s: float,
    proc: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
) -> float:
    """Wait for ``cond()`` (bounded); the seconds it took."""
    start = time.monotonic()
    while not cond():
        tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
        assert proc is None or proc.poll() is None, f"{what}: the process exited\n{tail}"
        assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s} s\n{tail}"
        time.sleep(0.1)
    return time.monotonic() - start


def _ready(url: str) -> tuple[int, str | None]:
    try:
        r = httpx.get(f"{url}/ready", timeout=2)
    except httpx.HTTPError as e:
        return 0, repr(e)
    return r.status_code, r.json().get("reason")


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _nodes(url: str) -> dict[str, dict[str, Any]]:
    return {n["id"]: n for n in httpx.get(f"{url}/admin/nodes", timeout=10).json()["nodes"]}


def _ready_of(url: str, role: str) -> set[str]:
    return {n for n, v in _nodes(url).items() if v["role"] == role and v["state"] == "ready"}


def _pd_nodes_on(hosts: NetnsHosts, host: Host) -> list[str]:
    """The pd node processes running on ``host`` (their process names)."""
    names = []
    for pid in hosts.pids(host):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm in _PD_NODE:
            names.append(comm)
    return sorted(names)


def _node_sockets(hosts: NetnsHosts, host: Host) -> list[tuple[str, str, str]]:
    """(state, local address, peer address) of every TCP socket of a pd node process there."""
    out = []
    for line in hosts.sockets(host).splitlines()[1:]:
        if any(f'(("{name}"' in line for name in _PD_NODE):
            state, _, _, local, peer = line.split()[:5]
            out.append((state, _ip(local), _ip(peer)))
    return out


def _ip(addr: str) -> str:
    return addr.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:")


def _why_gone(node_id: str) -> str:
    """Why pd dropped ``node_id``, from pd serve's log (its client logs each death)."""
    log = (ROOT / "serve.log").read_text(errors="replace").replace("\r", "")  # through a pty
    m = re.search(rf"node {node_id} is gone \((.*)\)$", log, re.M)
    return m.group(1) if m else "?"


def _concurrently(fns: list[Callable[[], Outcome]]) -> Callable[[], list[Outcome]]:
    out: list[Outcome] = []
    threads = [threading.Thread(target=lambda f=f: out.append(f()), daemon=True) for f in fns]
    for t in threads:
        t.start()

    def join() -> list[Outcome]:
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a request hung"
        return out

    return join


def _check(outcomes: list[Outcome], reference: list[list[int]]) -> None:
    for o in outcomes:
        assert o.error is None and o.tokens == reference[o.prompt], o


def _idle_and_whole(url: str) -> dict[str, dict[str, Any]]:
    """Every node holds no request and no slot; each pair group is to a live peer (one each
    way at most: KV to decode, pulls between any two). The counts come with the nodes' stats,
    a report behind the last answer: wait (bounded) for the report after it."""

    def idle() -> bool:
        return all(n["load"] == 0 and n["slots_in_use"] == 0 for n in _nodes(url).values())

    _until(idle, "every node idle", 30)
    nodes = _nodes(url)
    for node_id, n in nodes.items():
        peers = len(nodes) - 1
        assert n["state"] == "ready" and n["load"] == 0 and n["slots_in_use"] == 0, n
        assert n["pair_groups"] <= 2 * peers, (node_id, n, peers)
    return nodes


# -- the tests, in order -------------------------------------------------------------------


def test_ray_up_then_pd_serve_across_three_hosts_answers_like_one_host(onprem, reference) -> None:
    c, hosts = onprem, onprem.hosts
    outcomes = [_generate(c.url, i) for i in range(4)]
    _check(outcomes, reference)
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    again = httpx.post(
        f"{c.url}/generate",
        json={**body, "sampling_params": {**body["sampling_params"], "ignore_eos": True}},
        timeout=60,
    ).json()
    assert again["output_ids"] == reference[0]
    assert again["cached_tokens"] >= len(PROMPTS[0]) - 1  # the prefill node's cache hit
    # placement: each role on the host offering its resource, nothing on the head
    assert _pd_nodes_on(hosts, c.prefill_host) == ["ray::PrefillNod"]
    assert _pd_nodes_on(hosts, c.decode_host) == ["ray::DecodeNode"]
    assert _pd_nodes_on(hosts, c.head) == []
    # the KV crossed, prefill host -> decode host: for each new prompt (the repeated one moves
    # no KV when the decode node's cache event reached the coordinator first). The counts come
    # with the nodes' stats, which may be a report behind the last answer.
    _until(lambda: _metric(c.url, "pd_transfer_count") >= 4, "4 transfers counted", 10)
    assert _metric(c.url, "pd_transfer_count") <= 5 and _metric(c.url, "pd_transfer_bytes") > 0
    prefill, decode = c.prefill_host.ip, c.decode_host.ip
    hosts_ips = (c.head.ip, prefill, decode)
    p_socks, d_socks = _node_sockets(hosts, c.prefill_host), _node_sockets(hosts, c.decode_host)
    assert ("ESTAB", prefill, decode) in p_socks and ("ESTAB", decode, prefill) in d_socks
    # every socket of the two node processes is on its host's own address, nothing on loopback;
    # the one exception is Ray's: its core worker's gRPC server listens on every interface
    wildcard = [s for s in p_socks + d_socks if s[1] in ("*", "0.0.0.0", "::")]
    assert len(wildcard) == 2 and all(s[0] == "LISTEN" for s in wildcard), wildcard
    for state, local, peer in p_socks + d_socks:
        assert state == "LISTEN" or (local in (prefill, decode) and peer in hosts_ips), (
            state,
            local,
            peer,
        )
        assert "127.0.0.1" not in (local, peer), (state, local, peer)
    pairs = sorted({f"{local} <-> {peer}" for _, local, peer in p_socks if peer == decode})
    REPORT.append(
        f"KV sockets of the prefill node (h2) to the decode node (h3): {', '.join(pairs)}"
    )
    REPORT.append(
        f"every other socket of both nodes on {prefill} / {decode}, none on 127.0.0.1; one wildcard"
        " listener each: Ray's core worker gRPC server"
    )
    # the hosts' Ray is apart from this machine's: one session in the head's own /tmp/ray
    sessions = {s for s in hosts.ssh(c.head, "ls /tmp/ray").split() if s.startswith("session_2")}
    assert len(sessions) == 1 and not sessions & c.tmp_ray_before, (sessions, c.tmp_ray_before)


def test_a_host_cut_off_shorter_than_the_heartbeat_timeout_changes_nothing(
    onprem, reference
) -> None:
    c, hosts = onprem, onprem.hosts
    failed, ids = _metric(c.url, "pd_failed_nodes"), set(_nodes(c.url))
    load = Load(c.url, num_threads=2)
    time.sleep(1.0)
    hosts.cut(c.decode_host)
    cut_for = HEARTBEAT_S / 2
    statuses = set()
    deadline = time.monotonic() + cut_for
    while time.monotonic() < deadline:
        statuses.add(_ready(c.url)[0])
        time.sleep(0.1)
    hosts.reconnect(c.decode_host)
    time.sleep(3.0)
    outcomes = load.stop()
    assert statuses == {200}, statuses
    _check(outcomes, reference)
    assert _metric(c.url, "pd_failed_nodes") == failed and set(_nodes(c.url)) == ids
    _idle_and_whole(c.url)
    REPORT.append(
        f"decode host cut for {cut_for:.0f} s (< {HEARTBEAT_S:.0f} s timeout): {len(outcomes)} requests, none failed, no node lost, /ready stayed 200"
    )


def test_a_host_cut_off_longer_than_the_heartbeat_timeout_is_replaced_when_back(
    onprem, reference
) -> None:
    c, hosts = onprem, onprem.hosts
    rerouted, failed = _metric(c.url, "pd_rerouted_requests"), _metric(c.url, "pd_failed_nodes")
    old = {n for n, v in _nodes(c.url).items() if v["role"] == "decode"}
    start = time.monotonic()
    hosts.cut(c.decode_host)
    join = _concurrently([lambda i=i: _generate(c.url, i) for i in range(3)])  # routed there
    _until(lambda: _ready(c.url) == (503, "no live decode node (1 starting)"), "503", 10)
    dead = time.monotonic() - start
    health = httpx.get(f"{c.url}/health", timeout=5).status_code
    time.sleep(max(0.0, start + HEARTBEAT_S + 2 - time.monotonic()))
    cut_for = time.monotonic() - start
    hosts.reconnect(c.decode_host)
    replaced = _until(lambda: _ready(c.url)[0] == 200, "replacement ready", 90)
    outcomes = join()
    _check(outcomes, reference)
    assert health == 200  # /health counts the starting replacement; /ready does not
    assert _metric(c.url, "pd_failed_nodes") == failed + 1
    assert _metric(c.url, "pd_rerouted_requests") > rerouted  # dispatched to the cut node first
    nodes = _idle_and_whole(c.url)
    new = {n for n, v in nodes.items() if v["role"] == "decode"}
    assert len(new) == 1 and not new & old
    # the replacement runs on the decode host (the only one with "decode"); the old node's
    # process there was killed once the host was back; the survivor kept nothing for it
    _until(lambda: _pd_nodes_on(hosts, c.decode_host) == ["ray::DecodeNode"], "old node gone", 30)
    # Each side holds at most one pair group, to its one live peer (checked above); one more
    # request makes sure that group is there, on both sides (a pair is built on first use, and
    # one that broke while the old node was cut off is rebuilt only by the next transfer).
    _check([_generate(c.url, 0)], reference)
    # the nodes' stats (a heartbeat behind) show it finished, and one pair group each
    pairs = lambda: {n: (v["load"], v["pair_groups"]) for n, v in _nodes(c.url).items()}  # noqa: E731
    _until(lambda: set(pairs().values()) == {(0, 1)}, "idle, one pair group each", 10)
    _idle_and_whole(c.url)
    (gone,) = old
    REPORT.append(
        f"decode host cut for {cut_for:.1f} s (> {HEARTBEAT_S:.0f} s): {gone} gone ({_why_gone(gone)}), /ready 503 after {dead:.1f} s "
        f"(/health 200), node replaced {replaced:.1f} s after the link came back; "
        f"{len(outcomes)} requests sent during the cut re-routed, all answered like one host"
    )


def test_a_host_that_joins_after_start_takes_the_node_pd_scale_adds(onprem, reference) -> None:
    c, hosts = onprem, onprem.hosts
    late = c.host(4)  # listed in the yaml since `ray up`, made after pd serve started
    took = c.ray.wait_joined(late.index, 90)
    start = time.monotonic()
    pd = Path(sys.executable).parent / "pd"
    out = subprocess.run(
        [str(pd), "scale", "--url", c.url, "--prefill", "2", "--timeout", "120"],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    scaled = time.monotonic() - start
    assert _pd_nodes_on(hosts, late) == ["ray::PrefillNod"]  # the only free "prefill" was there
    _check(_concurrently([lambda i=i: _generate(c.url, i) for i in range(4, 8)])(), reference)
    REPORT.append(
        f"h4 ({late.ip}) made after pd serve started, joined Ray (waited {took:.1f} s more here); pd scale --prefill 2 placed prefill there in {scaled:.1f} s"
    )


def test_a_killed_host_is_replaced_on_another_host_with_its_role(onprem, reference) -> None:
    c, hosts = onprem, onprem.hosts
    late = c.host(4)
    failed = _metric(c.url, "pd_failed_nodes")
    old = {n for n, v in _nodes(c.url).items() if v["role"] == "prefill"}
    start = time.monotonic()
    hosts.kill(c.prefill_host)  # every process of h2: its Ray, its pd node, its sshd
    join = _concurrently([lambda i=i: _generate(c.url, i) for i in range(3)])
    _until(lambda: _metric(c.url, "pd_failed_nodes") == failed + 1, "found dead", 15)
    dead = time.monotonic() - start
    assert _ready(c.url)[0] == 200  # the other prefill node is live
    _until(lambda: len(_ready_of(c.url, "prefill") - old) == 1, "replacement", 90)
    replaced = time.monotonic() - start
    _check(join(), reference)
    assert _pd_nodes_on(hosts, late) == ["ray::PrefillNod", "ray::PrefillNod"]
    (gone,) = old - set(_nodes(c.url))
    _idle_and_whole(c.url)
    REPORT.append(
        f"prefill host h2 killed: {gone} found dead after {dead:.1f} s ({_why_gone(gone)}), replaced on h4 (prefill: 2) {replaced:.1f} s after the kill"
    )


def test_ray_down_leaves_no_process_on_any_host(onprem) -> None:
    c, hosts = onprem, onprem.hosts
    assert c.serve is not None
    hosts.stop_launched(c.serve)  # as when its terminal closes: ray exec's ssh session ends
    c.serve = None
    _until(lambda: not any("pd serve" in p for p in hosts.processes(c.head)), "pd serve ends", 30)
    start = time.monotonic()
    c.ray.down()
    down = time.monotonic() - start
    live = [h for h in hosts.hosts if h is not c.prefill_host]  # h2 was killed
    empty = _until(lambda: not any(hosts.processes(h) for h in live), "no process left", 60)
    REPORT.append(
        f"ray down: {down:.1f} s, every process on every host gone {down + empty:.1f} s after it started"
    )
