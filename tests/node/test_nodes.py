"""A Node and a Node in this process, over the fake transfer backend and a tiny
random model, driven one loop iteration at a time: no Ray, no sleeps."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest

from decode.node import DecodeRole
from pd.core.messages import AbortMsg, LocalReqMsg
from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from pd.node import Node, NodeConfig
from prefill.node import PrefillRole
from tests.node.harness import (
    GREEDY,
    PROMPTS,
    SECRET,
    Server,
    assert_idle,
    run_until,
    send_request,
)
from transfer.state import TransferConfig

pytestmark = pytest.mark.timeout(90)  # fixtures load models; each test runs in ~0.1 s


@pytest.fixture(scope="module")
def nodes(engine_cfg: EngineConfig, server: Server) -> Iterator[tuple[Node, Node]]:
    fake = TransferConfig(backend="fake", timeout_s=5.0, handshake_timeout_s=5.0, secret=SECRET)
    p = Node(engine_cfg, NodeConfig("prefill-0", server.addr, transfer=fake), PrefillRole)
    d = Node(engine_cfg, NodeConfig("decode-0", server.addr, transfer=fake), DecodeRole)
    yield p, d
    server.close()
    p.shutdown()
    d.shutdown()


@pytest.fixture(scope="module")
def reference(engine_cfg: EngineConfig) -> list[list[int]]:
    engine = Engine(engine_cfg)
    return [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]


def test_disaggregated_greedy_equals_the_colocated_engine(server, nodes, reference) -> None:
    p, d = nodes
    for i, prompt in enumerate(PROMPTS):
        send_request(server, p, d, f"r{i}", prompt)
    run_until(server, nodes, lambda: len(server.finished) >= len(PROMPTS))
    assert [server.tokens[f"r{i}"] for i in range(len(PROMPTS))] == reference
    assert all(m.finish_reason == "length" and m.error is None for m in server.finished.values())
    assert server.finished["r0"].num_prompt_tokens == len(PROMPTS[0])
    assert any(e.node_id == "prefill-0" and e.kind == "inserted" for e in server.events)
    assert {"prefill-0", "decode-0"} <= set(server.stats)  # each loop published its stats
    assert p.role.transfer_counters().num_done == len(PROMPTS)
    assert_idle(p, d)


def test_a_request_done_at_its_first_token_frees_both_sides(server, nodes) -> None:
    p, d = nodes
    send_request(server, p, d, "one", PROMPTS[0], SamplingParams(max_tokens=1, temperature=0))
    run_until(server, nodes, lambda: "one" in server.finished)
    assert len(server.tokens["one"]) == 1
    run_until(server, nodes, lambda: d.count_unfinished() == 0, max_iters=100)
    assert_idle(p, d)


def test_a_transfer_that_ends_during_a_forward_is_announced_before_the_forward_ends(
    server, nodes, reference, monkeypatch
) -> None:
    """The first token of a request whose KV went across while the prefill node computes the
    next batch reaches the server during that forward (``PrefillRole.between_layers``), not
    after it. Here the decode node runs inside the prefill node's next forward, and that
    forward waits for the token (at most 10 s) before it computes anything."""
    p, d = nodes
    send_request(server, p, d, "first", PROMPTS[0])
    # only the prefill node runs: "first" is prefilled; its transfer waits for the decode node
    run_until(server, (p,), lambda: len(p.role.outgoing.sending()) == 1)
    # done at its first token: no transfer of its own, so its forward's layers send nothing
    one = SamplingParams(max_tokens=1, temperature=0.0)
    send_request(server, p, d, "second", PROMPTS[1], one)
    real_run = p.core.runner.run
    during: dict[str, bool] = {}

    def run(reqs, seqs, on_layer, *args):  # type: ignore[no-untyped-def]
        if any(r.request_id == "second" for r in reqs):
            deadline = time.monotonic() + 10.0
            while "first" not in server.tokens and time.monotonic() < deadline:
                d.run_once(block=False)  # the decode node reserves, receives, acknowledges
                on_layer(0)  # a decoder layer of this forward finished
                server.drain()
                time.sleep(0.001)
            during["first"] = "first" in server.tokens
        return real_run(reqs, seqs, on_layer, *args)

    monkeypatch.setattr(p.core.runner, "run", run)
    run_until(server, nodes, lambda: {"first", "second"} <= set(server.finished))
    assert during == {"first": True}
    assert server.tokens["first"] == reference[0] and len(server.tokens["second"]) == 1
    assert server.senders["first"][0] == "decode-0"  # the decode node streamed its first token
    run_until(server, nodes, lambda: d.count_unfinished() == p.count_unfinished() == 0)
    assert_idle(p, d)


def test_a_new_pair_group_connects_during_a_forward_longer_than_its_connect_timeout(
    engine_cfg, server, reference, monkeypatch
) -> None:
    """A prefill node's first request to a decode node builds their pair group (gloo) while
    its forward runs; the rendezvous goes through the nodes' control sockets, and must finish
    within ``connect_timeout_s`` (1 s here) however long the forward takes (3 s here, like a
    cold burst of long prompts on a slow CPU): ``PrefillRole.between_layers`` moves it on."""
    gloo = TransferConfig(
        backend="gloo", connect_timeout_s=1.0, timeout_s=10.0, handshake_timeout_s=10.0,
        secret=SECRET,
    )  # fmt: skip
    p = Node(engine_cfg, NodeConfig("prefill-9", server.addr, transfer=gloo), PrefillRole)
    d = Node(engine_cfg, NodeConfig("decode-9", server.addr, transfer=gloo), DecodeRole)
    real_run = p.core.runner.run

    def run(reqs, seqs, on_layer, *args):  # type: ignore[no-untyped-def]
        end = time.monotonic() + 3.0  # the forward's layers, while the decode node runs
        while time.monotonic() < end:
            d.run_once(block=False)
            on_layer(0)
            server.drain()
            time.sleep(0.005)
        return real_run(reqs, seqs, on_layer, *args)

    try:
        monkeypatch.setattr(p.core.runner, "run", run)
        send_request(server, p, d, "paired", PROMPTS[0])
        run_until(server, (p, d), lambda: "paired" in server.finished)
        assert server.finished["paired"].error is None
        assert server.tokens["paired"] == reference[0]
        assert p.transfer.num_pairs == 1  # connected once, never broken
        run_until(server, (p, d), lambda: d.count_unfinished() == p.count_unfinished() == 0)
        assert_idle(p, d)
    finally:
        for node in (p, d):
            sock, _ = server.push.pop(node.addr, (None, None))
            if sock is not None:
                sock.close(linger=0)
            node.shutdown()


@pytest.mark.parametrize("when", ["before_prefill", "while_decoding"])
def test_abort_frees_both_nodes(server, nodes, when: str) -> None:
    p, d = nodes
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    rid = f"abort-{when}"
    send_request(server, p, d, rid, PROMPTS[1], long)
    if when == "while_decoding":
        run_until(server, nodes, lambda: len(server.tokens.get(rid, [])) >= 3)
    for node in nodes:
        server.send(node, AbortMsg(request_id=rid))
    run_until(server, nodes, lambda: p.count_unfinished() == d.count_unfinished() == 0)
    assert_idle(p, d)


def test_malformed_messages_are_counted_and_dropped(server, nodes) -> None:
    p, d = nodes
    before = p.inbox.num_bad_msgs
    server.send_raw(p, b"\x00garbage")  # authentic frames, malformed messages
    server.send_raw(p, msgspec.msgpack.encode({"type": "prefill_req", "request_id": 5}))
    run_until(server, nodes, lambda: p.inbox.num_bad_msgs == before + 2, max_iters=2000)
    send_request(server, p, d, "after-garbage", PROMPTS[2])
    run_until(server, nodes, lambda: "after-garbage" in server.finished)
    assert server.finished["after-garbage"].error is None


def test_a_failed_forward_fails_its_batch_and_the_node_goes_on(server, nodes, monkeypatch) -> None:
    p, d = nodes
    runner = d.core.runner
    real_run = runner.run
    calls = {"n": 0}

    def flaky_run(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return real_run(*args)

    monkeypatch.setattr(runner, "run", flaky_run)
    send_request(server, p, d, "victim", PROMPTS[0])
    run_until(server, nodes, lambda: "victim" in server.finished)
    assert "forward failed: injected" in (server.finished["victim"].error or "")
    send_request(server, p, d, "survivor", PROMPTS[0])
    run_until(server, nodes, lambda: "survivor" in server.finished)
    assert server.finished["survivor"].error is None
    assert_idle(p, d)


def test_a_decode_node_prefills_a_local_request_beside_transferred_ones(
    server, nodes, reference
) -> None:
    """Conditional disaggregation's node side: a LocalReqMsg is prefilled on the decode node,
    interleaved with requests whose KV came from the prefill node; all equal the reference."""
    p, d = nodes
    send_request(server, p, d, "via-prefill-0", PROMPTS[0])
    server.send(
        d, LocalReqMsg(request_id="local-1", prompt_ids=PROMPTS[1], sampling=GREEDY, namespace="")
    )
    send_request(server, p, d, "via-prefill-2", PROMPTS[2])
    names = ["via-prefill-0", "local-1", "via-prefill-2"]
    run_until(server, nodes, lambda: all(n in server.finished for n in names))
    assert [server.tokens[n] for n in names] == reference
    assert server.finished["local-1"].num_prompt_tokens == len(PROMPTS[1])
    assert_idle(p, d)
