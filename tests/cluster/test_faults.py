"""Faults on a live cluster (Ray, 2 prefill + 2 decode nodes, the tiny random model) under a
steady stream of requests: nodes killed mid-prefill and mid-transfer, a frozen node, extreme
sampling parameters in one batch. Un-started requests complete elsewhere with the reference
output, and so do streams on a frozen then dead decode node (they fail over; a decode node
killed mid-stream, with more kinds of request: ``tests/cluster/test_failover_live.py``);
nothing hangs, and the survivors hold no slot, pair group, socket or thread for the dead."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import httpx
import pytest

from pd.cluster.client_config import ClientConfig
from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from tests.cluster.conftest import LiveCluster, wait_idle_and_check
from transfer.state import TransferConfig

pytestmark = pytest.mark.timeout(300)  # the live cluster's start-up is counted too
HEARTBEAT_S = 4.0
MAX_TOKENS = 12
LONG = 460  # + a prompt of at most 40 tokens: within the tiny model's 512 positions
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, 40000) for _ in range(_rng.randrange(8, 40))] for _ in range(8)]


class Outcome(NamedTuple):
    prompt: int
    tokens: list[int]
    error: str | None  # an error event (stream) or a non-200 answer


@pytest.fixture(scope="module")
def live_spec(tiny_llama_dir) -> dict[str, Any]:
    return dict(
        num_prefill=2,
        num_decode=2,
        policy="round_robin",
        model=str(tiny_llama_dir),
        client=ClientConfig(heartbeat_timeout_s=HEARTBEAT_S, request_timeout_s=90.0),
        transfer=TransferConfig(handshake_timeout_s=10.0, timeout_s=5.0, connect_timeout_s=5.0),
    )


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[list[int]]:
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), max_total_tokens=2048))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [r.token_ids for r in engine.generate(PROMPTS, params)]


def _generate(url: str, i: int, max_tokens: int = MAX_TOKENS, **sampling: Any) -> Outcome:
    """One streamed /generate request: its tokens, and the error event if one came."""
    params = {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **sampling}
    body = {"input_ids": PROMPTS[i], "sampling_params": params, "stream": True}
    tokens: list[int] = []
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=90) as r:
        if r.status_code != 200:
            r.read()
            return Outcome(i, tokens, f"HTTP {r.status_code}: {r.text}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return Outcome(i, tokens, event["error"]["message"])
            tokens.extend(event["output_ids"])
    return Outcome(i, tokens, None)


class Load:
    """A steady stream of requests from a few threads until ``stop()``."""

    def __init__(self, url: str, num_threads: int = 2) -> None:
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(url, t), daemon=True)
            for t in range(num_threads)
        ]
        for t in self._threads:
            t.start()

    def _run(self, url: str, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            self.outcomes.append(_generate(url, rng.randrange(len(PROMPTS))))

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in self._threads), "a request hung"
        return self.outcomes


def _check(outcomes: list[Outcome], reference: list[list[int]]) -> None:
    """Every request got the reference output, whatever node died under it."""
    for o in outcomes:
        assert o.error is None and o.tokens == reference[o.prompt], o


def _concurrently(fns: list[Callable[[], Outcome]]) -> tuple[list[Outcome], Callable[[], None]]:
    out: list[Outcome] = []
    threads = [threading.Thread(target=lambda f=f: out.append(f()), daemon=True) for f in fns]
    for t in threads:
        t.start()

    def join() -> None:
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a request hung"

    return out, join


def _wait(cond: Callable[[], Any], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


def _pid(live: LiveCluster, node_id: str) -> int:
    return live.cluster.client.membership.nodes[node_id].pid  # type: ignore[attr-defined]


def _on(live: LiveCluster, role: str) -> list[str]:
    return sorted(n for n, i in live.cluster.client.membership.nodes.items() if i.role == role)  # type: ignore[attr-defined]


def _clean(live: LiveCluster, restored: bool = False) -> None:
    """Every node idle, its pool whole, its pair groups only to live peers, its transfers
    closed and no thread beyond what those pairs need. ``restored``: first wait until the
    replacements of the dead have joined (2 + 2 nodes again)."""
    client = live.cluster.client  # type: ignore[attr-defined]
    if restored:
        _wait(lambda: len(_on(live, "prefill")) == len(_on(live, "decode")) == 2, "replacements")
    report = wait_idle_and_check(live, timeout_s=30)
    for node_id, r in report.items():
        # a pair group each way per live peer at most (KV to decode, pulls between any two)
        peers = len(report) - 1
        assert r["pairs"] <= 2 * peers and r["transfers"] == 0, (node_id, r)
        assert r["sockets"] <= 3 + 2 * peers, (node_id, r)  # own 3 + a push and a dealer each
        assert r["pair_threads"] <= 2 * r["pairs"], (node_id, r)  # a worker and a copier each
        # every other thread of the node's process is there from its start on
        other = _OTHER_THREADS.setdefault(node_id, r["threads"] - r["pair_threads"])
        assert r["threads"] - r["pair_threads"] == other, (node_id, r, other)
    assert set(report) == set(client.membership.nodes)


_OTHER_THREADS: dict[str, int] = {}  # node -> its threads outside pair groups, when first seen


def test_prefill_node_killed_mid_prefill(live, reference) -> None:
    client = live.cluster.client
    victim = _on(live, "prefill")[0]
    load = Load(live.url)
    os.kill(_pid(live, victim), signal.SIGSTOP)  # its requests queue there, un-started
    out, join = _concurrently([lambda i=i: _generate(live.url, i) for i in range(4)])
    _wait(
        lambda: client.membership.num_routed_to(victim) >= 2, "requests routed to the frozen node"
    )
    os.kill(_pid(live, victim), signal.SIGKILL)
    join()
    _check(out, reference)
    assert victim in client.membership.dead_nodes and client.flights.num_rerouted >= 2
    _check(load.stop(), reference)
    _clean(live)


def test_prefill_node_killed_mid_transfer(live, reference) -> None:
    client = live.cluster.client
    decode = _on(live, "decode")
    load = Load(live.url)
    for d in decode:  # transfers wait for the decode nodes' answers: the KV is in flight
        os.kill(_pid(live, d), signal.SIGSTOP)
    try:
        out, join = _concurrently([lambda i=i: _generate(live.url, i) for i in range(4)])

        def transferring() -> str | None:
            for n in _on(live, "prefill"):
                stats = client.membership.node_stats.get(n)
                if stats is not None and stats.num_transferring > 0:
                    return n
            return None

        _wait(transferring, "a prefill node with transfers in flight", timeout=HEARTBEAT_S - 1)
        victim = transferring()
        assert victim is not None
        os.kill(_pid(live, victim), signal.SIGKILL)
    finally:
        for d in decode:  # within the heartbeat timeout: they stay alive
            os.kill(_pid(live, d), signal.SIGCONT)
    join()
    _check(out, reference)
    assert victim in client.membership.dead_nodes and not set(decode) & set(
        client.membership.dead_nodes
    )
    _check(load.stop(), reference)
    _clean(live)


def test_a_frozen_node_is_dead_within_the_heartbeat_timeout(live, reference) -> None:
    client = live.cluster.client
    victim = _on(live, "decode")[0]
    pid = _pid(live, victim)
    load = Load(live.url)
    os.kill(pid, signal.SIGSTOP)  # the process lives; its Ray actor may even answer pings
    frozen_at = time.monotonic()
    try:
        _wait(
            lambda: victim in client.membership.dead_nodes, "the frozen node found dead", timeout=15
        )
        took = time.monotonic() - frozen_at
        assert took <= HEARTBEAT_S + 2.0, took
        assert "no heartbeat" in client.membership.dead_nodes[victim]
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGCONT)  # it wakes up to find itself replaced, then killed
    _wait(lambda: not _alive(pid), "the frozen node's process killed", timeout=30)
    _check(load.stop(), reference)
    _clean(live)


def test_extreme_sampling_parameters_fail_alone(live, reference) -> None:
    extremes: list[dict[str, Any]] = [
        {"temperature": 1e-30},  # greedy
        {"temperature": 2.0, "top_p": 1e-9},  # only the top token survives
        {"temperature": 2.0, "top_k": 10**9},
        {"temperature": 1.0, "seed": 0},
        {"temperature": 1.0, "seed": 2**64 - 1},
        {"temperature": 1.0, "seed": -(2**63)},
        {"temperature": 1.0, "seed": 2**64},  # beyond any generator's seed
        {"temperature": 1.0, "seed": 2**200},
    ]
    normal = [lambda i=i: _generate(live.url, i) for i in range(4)]
    odd = [lambda e=e: _generate(live.url, 4, **e) for e in extremes]
    out, join = _concurrently(normal + odd)
    join()
    by_prompt = {o.prompt: o for o in out if o.prompt < 4}
    _check(list(by_prompt.values()), reference)
    odd_out = [o for o in out if o.prompt == 4]
    assert len(odd_out) == len(extremes)
    for o in odd_out:  # served (legal) or refused with a message; never a hang
        assert o.error is None and len(o.tokens) == MAX_TOKENS or o.error, o
    greedy_like = [o for o in odd_out if o.error is None and o.tokens == reference[4]]
    assert len(greedy_like) >= 2  # temperature 1e-30 and top_p 1e-9 act greedily
    _clean(live, restored=True)
    assert httpx.get(f"{live.url}/ready", timeout=5).status_code == 200  # every pool live
    metrics = httpx.get(f"{live.url}/metrics", timeout=5).text
    for gauge in ("pd_node_pair_groups{", "pd_node_threads{", "pd_rerouted_requests "):
        assert gauge in metrics, gauge


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (killed, not yet reaped) is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
