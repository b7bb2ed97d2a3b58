"""Faults seen from the nodes: a peer that dies or leaves (``PeerGoneMsg``), a request whose own
handling raises, an abort racing a failing transfer, and the heartbeat of a long forward. Fresh
in-process nodes per test (tiny model, fake transfer backend), driven one iteration at a time."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest

from pd.core.messages import (
    AbortMsg,
    DecodeReqMsg,
    PeerGoneMsg,
    PeerUpMsg,
    PrefilledMsg,
    PrefillReqMsg,
)
from pd.core.request import ReqStatus
from pd.core.sampling_params import SamplingParams
from pd.model.decoder import DecoderLayer
from pd.node import Node
from tests.node.harness import PROMPTS, assert_idle, run_until, send_request
from transfer.backend import FakeTransferBackend
from transfer.state import KVPoll

pytestmark = pytest.mark.timeout(60)
LONG = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)


def _gone(node: Node) -> PeerGoneMsg:
    info = node.info()
    return PeerGoneMsg(node_id=info.node_id, addr=info.addr, transfer_addr=info.transfer_addr)


def test_the_first_token_streams_from_the_decode_node(server, make_pair) -> None:
    p, d = make_pair()
    send_request(server, p, d, "via-decode", PROMPTS[0])
    one = SamplingParams(max_tokens=1, temperature=0.0)
    send_request(server, p, d, "at-prefill", PROMPTS[1], one)
    run_until(server, (p, d), lambda: {"via-decode", "at-prefill"} <= set(server.finished))
    assert set(server.senders["via-decode"]) == {d.node_id}
    assert len(server.tokens["via-decode"]) == 6
    assert server.senders["at-prefill"] == [p.node_id]  # done at its first token: answered there
    # The prefill node's AbortMsg may overtake the server's DecodeReqMsg (two sockets into one
    # inbox); the server tells the decode node to forget a finished request too, as here.
    server.send(d, AbortMsg(request_id="at-prefill"))
    run_until(server, (p, d), lambda: d.count_unfinished() == 0)
    assert_idle(p, d)


def test_an_abort_that_overtakes_its_request_leaves_no_record(server, make_pair) -> None:
    """The prefill node's AbortMsg for a request done at its first token comes on its own
    socket and can reach the decode node before the server's DecodeReqMsg: the request that
    follows is dropped on arrival, not kept EXPECTED for KV that never comes (an idle node that
    polls for it, a drain that waits its deadline)."""
    p, d = make_pair()
    server.send(d, AbortMsg(request_id="overtaken", reason="finished at prefill"))
    run_until(server, (d,), lambda: len(d.role.recent_aborts) == 1, max_iters=200)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    server.send(
        d,
        DecodeReqMsg(
            request_id="overtaken", prompt_ids=PROMPTS[0], sampling=one, namespace="",
            prefill_node=p.node_id,
        ),
    )  # fmt: skip
    run_until(server, (d,), lambda: len(d.role.recent_aborts) == 0, max_iters=200)
    assert d.role.incoming.ids() == [] and d.count_unfinished() == 0
    assert_idle(d)


def test_recent_aborts_are_bounded_in_number_and_age() -> None:
    from decode.incoming import RecentAborts

    now = [0.0]
    aborts = RecentAborts(max_ids=3, max_age_s=10.0, clock=lambda: now[0])
    for i in range(5):
        aborts.add(f"r{i}")
    assert len(aborts) == 3 and not aborts.take("r0") and aborts.take("r4")
    now[0] = 11.0
    assert not aborts.take("r3")  # too old: a request that late is not the overtaken one
    aborts.add("r5")
    assert len(aborts) == 1


@pytest.mark.parametrize("phase", ["expected", "reserved", "kv_landed"])
def test_a_dead_prefill_node_leaves_nothing_on_the_decode_node(server, make_pair, phase) -> None:
    p, d = make_pair()
    base = d.integrity()
    rid = f"dead-prefill-{phase}"
    send_request(server, p, d, rid, PROMPTS[0], LONG)
    if phase == "expected":  # the prefill node dies before it asks for slots
        run_until(
            server, (d,), lambda: rid in d.role.incoming.ids(ReqStatus.EXPECTED), max_iters=200
        )
    elif phase == "reserved":  # ... after the decode node reserved them
        run_until(server, (p, d), lambda: d.transfer.poll(rid) is not None, max_iters=2000)
    else:  # ... after the KV landed, before its PrefilledMsg was sent
        run_until(server, (p, d), lambda: d.transfer.poll(rid) == KVPoll.SUCCESS)
    assert d.count_unfinished() == 1
    server.send(d, _gone(p))  # p is never driven again: it is dead
    run_until(server, (d,), lambda: rid in server.finished, max_iters=2000)
    assert f"prefill node {p.node_id} is gone" in (server.finished[rid].error or "") or (
        "KV transfer from the prefill node failed" in (server.finished[rid].error or "")
    )
    run_until(server, (d,), lambda: d.count_unfinished() == 0, max_iters=2000)
    assert_idle(d)
    after = d.integrity()
    assert after["pairs"] == 0 and after["sockets"] == base["sockets"], (base, after)
    assert len(d.role.incoming) == 0


def test_a_dead_decode_node_leaves_nothing_on_the_prefill_node(server, make_pair) -> None:
    p, d = make_pair(handshake_timeout_s=30.0)
    base = p.integrity()
    # one request in its transfer (d is frozen: never driven), one waiting to be prefilled
    send_request(server, p, d, "in-transfer", PROMPTS[0], LONG)
    run_until(
        server, (p,), lambda: p.role.transfer_counters().num_transferring == 1, max_iters=2000
    )
    send_request(server, p, d, "queued", PROMPTS[1], LONG)
    run_until(server, (p,), lambda: p.scheduler.num_unfinished == 2, max_iters=200)
    server.send(p, _gone(d))
    run_until(server, (p,), lambda: {"in-transfer", "queued"} <= set(server.finished))
    for rid in ("in-transfer", "queued"):
        assert f"decode node {d.node_id} is gone" in (server.finished[rid].error or "")
    assert_idle(p)
    after = p.integrity()
    assert after["pairs"] == 0 and after["transfers"] == 0, after
    assert after["sockets"] == base["sockets"], (base, after)  # no socket left to d
    # a late request routed to the gone node fails at once instead of waiting out a handshake
    send_request(server, p, d, "late", PROMPTS[2], LONG)
    run_until(server, (p,), lambda: "late" in server.finished, max_iters=2000)
    assert "is closed" in (server.finished["late"].error or "")
    assert_idle(p)


def test_a_node_that_joins_at_a_gone_nodes_endpoints_is_served(server, make_pair) -> None:
    """A replacement node may be given the port of the node it replaces (what explains a
    failure seen once in a whole-suite run: every request to the new decode node failed,
    "peer ... is closed"). Once
    the server says it joined (``PeerUpMsg``), the prefill node sends to it again."""
    p, d = make_pair()
    server.send(p, _gone(d))
    send_request(server, p, d, "refused", PROMPTS[0])
    run_until(server, (p,), lambda: "refused" in server.finished, max_iters=2000)
    assert "is closed" in (server.finished["refused"].error or "")
    server.send(d, AbortMsg(request_id="refused"))  # as the server ends a failed attempt
    info = d.info()  # d plays the node that took the gone one's endpoints
    server.send(p, PeerUpMsg(node_id="d2", addr=info.addr, transfer_addr=info.transfer_addr))
    send_request(server, p, d, "served", PROMPTS[1])
    run_until(server, (p, d), lambda: "served" in server.finished)
    assert server.finished["served"].error is None
    assert len(server.tokens["served"]) == 6
    assert_idle(p, d)


def test_a_frozen_sender_that_wakes_up_cannot_reopen_a_pair(server, make_pair) -> None:
    p, d = make_pair(handshake_timeout_s=2.0)
    send_request(server, p, d, "before-freeze", PROMPTS[0], LONG)
    run_until(
        server, (p,), lambda: p.role.transfer_counters().num_transferring == 1, max_iters=2000
    )
    server.send(d, _gone(p))  # declared dead while frozen: d reads only its request socket
    for _ in range(2000):
        d._recv()
        server.drain()
        if "before-freeze" in server.finished:
            break
    assert "is gone" in (server.finished["before-freeze"].error or "")
    # ... then wakes up: its transfer request reaches d, which refuses it
    deadline = time.monotonic() + 10
    while p.count_unfinished() and time.monotonic() < deadline:
        p.run_once(block=False)
        d.run_once(block=False)
    assert_idle(p, d)
    assert d.integrity()["pairs"] == 0  # its requests were refused, no pair rebuilt


def test_a_reserve_that_raises_fails_that_request_alone(server, make_pair, monkeypatch) -> None:
    p, d = make_pair()
    real = d.role.scheduler.reserve_incoming

    def reserve(req, num_tokens):
        if req.request_id == "bad-reserve":
            raise RuntimeError("injected reserve failure")
        return real(req, num_tokens)

    monkeypatch.setattr(d.role.scheduler, "reserve_incoming", reserve)
    send_request(server, p, d, "bad-reserve", PROMPTS[0])
    send_request(server, p, d, "good-reserve", PROMPTS[1])
    run_until(server, (p, d), lambda: {"bad-reserve", "good-reserve"} <= set(server.finished))
    assert "injected reserve failure" in (server.finished["bad-reserve"].error or "")
    assert server.finished["good-reserve"].error is None
    assert len(server.tokens["good-reserve"]) == 6
    run_until(server, (p, d), lambda: p.count_unfinished() == d.count_unfinished() == 0)
    assert_idle(p, d)


def test_a_prefill_post_processing_error_fails_that_request_alone(
    server, make_pair, monkeypatch
) -> None:
    p, d = make_pair()
    real = p.peers.send

    def send_peer(addr: str, msg: Any) -> None:
        if isinstance(msg, PrefilledMsg) and msg.request_id == "bad-post":
            raise RuntimeError("injected post-processing failure")
        real(addr, msg)

    monkeypatch.setattr(p.peers, "send", send_peer)
    send_request(server, p, d, "bad-post", PROMPTS[0])
    send_request(server, p, d, "good-post", PROMPTS[1])
    run_until(server, (p, d), lambda: {"bad-post", "good-post"} <= set(server.finished))
    assert "injected post-processing failure" in (server.finished["bad-post"].error or "")
    assert server.finished["good-post"].error is None
    server.send(d, AbortMsg(request_id="bad-post"))  # what the server does when a request fails
    run_until(server, (p, d), lambda: p.count_unfinished() == d.count_unfinished() == 0)
    assert_idle(p, d)


@pytest.mark.parametrize("when", ["while_failing", "after_failed"])
def test_abort_racing_a_failing_transfer_leaks_nothing(
    server, make_pair, monkeypatch, when
) -> None:
    real_isend = FakeTransferBackend.isend

    def slow_isend(self: FakeTransferBackend, tensor: Any) -> Any:
        time.sleep(0.05)  # the payload crawls: the receiver's deadline passes mid-stream
        return real_isend(self, tensor)

    monkeypatch.setattr(FakeTransferBackend, "isend", slow_isend)
    p, d = make_pair(timeout_s=0.3)
    rid = f"race-{when}"
    send_request(server, p, d, rid, PROMPTS[0], LONG)
    run_until(server, (p, d), lambda: d.transfer.poll(rid) == KVPoll.TRANSFERRING)
    if when == "after_failed":
        run_until(server, (p, d), lambda: d.transfer.poll(rid) == KVPoll.FAILED)
    for node in (p, d):
        server.send(node, AbortMsg(request_id=rid))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (p.count_unfinished() or d.count_unfinished()):
        for node in (p, d):
            node.run_once(block=False)
        server.drain()
        time.sleep(0.01)
    assert_idle(p, d)
    assert d.integrity()["transfers"] == 0
    assert len(d.role.incoming) == 0


def test_a_long_forward_beats_between_its_layers(server, make_pair) -> None:
    p, _ = make_pair()
    p.node_cfg = dataclasses.replace(p.node_cfg, stats_interval_s=0.01)
    layers = [m for m in p.core.runner.model.modules() if isinstance(m, DecoderLayer)]
    handles = [m.register_forward_pre_hook(lambda *_: time.sleep(0.05)) for m in layers]
    try:
        p.run_once(block=False)  # publishes, so the next beat is due 10 ms later
        server.drain()
        before = server.num_stats
        server.send(p, _prefill_only(p))
        for _ in range(50):  # until the request is prefilled (one forward of 3 slow layers)
            if p.run_once(block=False):
                break
            time.sleep(0.01)
        deadline = time.monotonic() + 5  # the beats were sent; loopback delivers them soon
        while server.num_stats - before < len(layers) and time.monotonic() < deadline:
            server.drain()
            time.sleep(0.01)
        assert server.num_stats - before >= len(layers), (server.num_stats, before)
    finally:
        for h in handles:
            h.remove()
        server.send(p, AbortMsg(request_id="beats"))
        run_until(server, (p,), lambda: p.count_unfinished() == 0, max_iters=100)


def _prefill_only(p: Node) -> PrefillReqMsg:
    one = SamplingParams(max_tokens=1, temperature=0.0)
    return PrefillReqMsg(
        request_id="beats",
        prompt_ids=PROMPTS[0],
        sampling=one,
        namespace="",
        decode_node="decode-x",
        decode_addr="tcp://127.0.0.1:9",
        decode_transfer_addr="tcp://127.0.0.1:9",
    )
