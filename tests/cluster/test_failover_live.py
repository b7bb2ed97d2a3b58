"""Failover of started requests on a live cluster (Ray, 1 prefill + 2 decode nodes, the tiny
random model; real processes and signals): a decode node killed (SIGKILL) or frozen past the
heartbeat (SIGSTOP) while it streams. 10 ``/v1/completions`` requests, 16 streams of choices
of 200 tokens (greedy with logprobs; seeded ``n=2`` with logprobs; a JSON schema, seeded,
``n=2``), at the engine's defaults and with 4 speculative tokens: every stream it served fails
over to the other decode node and completes, and every choice's text, finish reason and
logprobs, and the usage, equal the undisturbed answer (each request alone first). In process,
with more sampling parameters: ``tests/cluster/test_failover.py``."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import httpx
import pytest

from pd.cluster.client_config import ClientConfig
from tests.cluster.conftest import LiveCluster, wait_idle_and_check
from tests.cluster.test_faults import _on, _pid, _wait
from transfer.state import TransferConfig

pytestmark = pytest.mark.timeout(600)  # the live cluster's start-up is counted too
HEARTBEAT_S = 8.0  # a frozen node is dead past it; a loaded 2-core machine stalls nodes for 4 s
NUM_REQUESTS = 10  # 16 streams of choices (KINDS' n)


@pytest.fixture(scope="module", params=["defaults", "speculative"])
def live_spec(request, tiny_llama_dir) -> dict[str, Any]:
    # speculating in every step, however many requests it holds
    spec = {"speculative_tokens": 4, "speculative_max_batch": 64}
    return dict(
        num_prefill=1,
        num_decode=2,
        model=str(tiny_llama_dir),
        engine_kwargs=spec if request.param == "speculative" else None,
        client=ClientConfig(heartbeat_timeout_s=HEARTBEAT_S, request_timeout_s=180.0),
        transfer=TransferConfig(handshake_timeout_s=10.0, timeout_s=5.0, connect_timeout_s=5.0),
    )


# Through /v1/completions: each kind of request, alone on the idle cluster first (the
# undisturbed answer), then all at once while a decode node dies under them.
FAILOVER_TOKENS = 200
POINT = {
    "type": "object",
    "properties": {"x": {"type": "number"}, "y": {"type": "integer"}},
    "required": ["x", "y"],
}
KINDS: list[dict[str, Any]] = [
    {"temperature": 0.0, "ignore_eos": True, "logprobs": 2},  # greedy
    {"temperature": 0.9, "seed": 11, "n": 2, "ignore_eos": True, "logprobs": 1},  # seeded
    {
        "temperature": 0.9,
        "seed": 5,
        "n": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": POINT}},
    },
]


class Answer(NamedTuple):
    request: int
    choices: dict[int, tuple[str, str | None, list[Any]]]  # index: text, finish, logprobs
    usage: dict[str, Any] | None
    error: str | None


def _completion(url: str, i: int) -> Answer:
    """Request ``i`` (of kind ``i % len(KINDS)``), streamed: what its caller sees."""
    body = {
        "prompt": f"Item {i} of the list, and what it weighs:",
        "max_tokens": FAILOVER_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
        **KINDS[i % len(KINDS)],
    }
    texts: dict[int, str] = {}
    ends: dict[int, str | None] = {}
    logprobs: dict[int, list[Any]] = {}
    usage = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return Answer(i, {}, None, f"HTTP {r.status_code}: {r.text}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return Answer(i, {}, None, event["error"]["message"])
            if event.get("usage"):  # (what the caches held is no part of the answer)
                usage = {k: v for k, v in event["usage"].items() if k != "prompt_tokens_details"}
            for c in event["choices"]:
                k = c["index"]
                texts[k] = texts.get(k, "") + c["text"]
                ends[k] = c.get("finish_reason") or ends.get(k)
                lp = c.get("logprobs")
                if lp:
                    got = logprobs.setdefault(k, [])
                    got += list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
    return Answer(i, {k: (texts[k], ends.get(k), logprobs.get(k, [])) for k in texts}, usage, None)


def _concurrently(fns: list[Callable[[], Answer]]) -> tuple[list[Answer], Callable[[], None]]:
    """Run ``fns`` on threads; the second result joins them (all within 240 s: none hangs)."""
    out: list[Answer] = []
    threads = [threading.Thread(target=lambda f=f: out.append(f()), daemon=True) for f in fns]
    for t in threads:
        t.start()

    def join() -> None:
        deadline = time.monotonic() + 240
        for t in threads:
            t.join(timeout=max(deadline - time.monotonic(), 0))
        assert not any(t.is_alive() for t in threads), "a request hung"

    return out, join


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_streams_on_a_dead_decode_node_fail_over_and_equal_the_undisturbed(
    live: LiveCluster, sig: str
) -> None:
    """A decode node killed, or frozen past the heartbeat, while it streams: every stream it
    served resumes on the other and its caller sees the undisturbed answer. Before failover,
    each ended with an error event (`node decode-N failed: ...`)."""
    client = live.cluster.client
    num = NUM_REQUESTS
    alone, join = _concurrently([lambda i=i: _completion(live.url, i) for i in range(num)])
    join()
    want = {a.request: a for a in alone}
    assert all(a.error is None for a in alone), alone
    failovers = client.flights.num_failovers
    out, join = _concurrently([lambda i=i: _completion(live.url, i) for i in range(num)])

    def streaming() -> str | None:
        # started = the server has their tokens, far from their end
        flights = list(client.flights._by_wire.values())
        for n in _on(live, "decode"):
            mid = [f for f in flights if f.decode == n and 0 < f.num_received < 100]
            if len(mid) >= 2:
                return n
        return None

    _wait(streaming, "a decode node with two streams started", timeout=30)
    victim = streaming()
    assert victim is not None
    pid = _pid(live, victim)
    os.kill(pid, signal.SIGSTOP)  # its streams stop where they are ...
    if sig == "SIGKILL":
        os.kill(pid, signal.SIGKILL)  # ... and its process is gone
    else:  # ... until the heartbeat judges it dead; woken, it finds itself replaced
        _wait(lambda: victim in client.membership.dead_nodes, "the frozen node found dead", 30)
        os.kill(pid, signal.SIGCONT)
    join()
    for a in out:
        assert a.error is None and a == want[a.request]._replace(error=None), (a, want[a.request])
    assert client.flights.num_failovers >= failovers + 2
    assert victim in client.membership.dead_nodes
    _wait(lambda: len(_on(live, "decode")) == 2, "the dead node's replacement", timeout=120)
    wait_idle_and_check(live)
