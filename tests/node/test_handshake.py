"""The prefill -> decode handshake when the prefill node's transfer request reaches the decode
node before the server's ``DecodeReqMsg`` (two sockets, no order between them): the decode
node holds it until the request arrives, so nothing is retried; past the hold's bounds the old
"no room, ask again" answer still gets the request through. Fresh in-process nodes per test
(tiny model, fake transfer backend), driven one iteration at a time."""

from __future__ import annotations

import time

import pytest

from pd.core.messages import AbortMsg, DecodeReqMsg, PrefillReqMsg
from pd.node import Node
from tests.node.harness import GREEDY, PROMPTS, Server, assert_idle, run_until, send_request

pytestmark = pytest.mark.timeout(60)


def _prefill_first(server: Server, p: Node, d: Node, rid: str) -> None:
    """The prefill node gets the request, prefills it and asks the decode node for slots, and
    the decode node reads that request, all before the server's ``DecodeReqMsg`` reaches it."""
    info = d.info()
    server.send(
        p,
        PrefillReqMsg(
            request_id=rid,
            prompt_ids=PROMPTS[0],
            sampling=GREEDY,
            namespace="",
            decode_node=d.node_id,
            decode_addr=info.addr,
            decode_transfer_addr=info.transfer_addr,
        ),
    )
    run_until(server, (p,), lambda: p.role.transfer_counters().num_transferring == 1)
    deadline = time.monotonic() + 5
    while d.transfer.num_held_requests + p.transfer.num_retries == 0:
        assert time.monotonic() < deadline, "the decode node never read the transfer request"
        d.transfer.progress()
        p.transfer.progress()


def _decode_req(p: Node, rid: str) -> DecodeReqMsg:
    return DecodeReqMsg(
        request_id=rid, prompt_ids=PROMPTS[0], sampling=GREEDY, namespace="", prefill_node=p.node_id
    )


def test_a_transfer_request_before_its_request_is_held_not_retried(server, make_pair) -> None:
    p, d = make_pair()
    send_request(server, p, d, "in-order", PROMPTS[0])
    run_until(server, (p, d), lambda: "in-order" in server.finished)
    _prefill_first(server, p, d, "raced")
    assert d.transfer.num_held_requests == 1
    server.send(d, _decode_req(p, "raced"))
    run_until(server, (p, d), lambda: "raced" in server.finished)
    assert server.finished["raced"].error is None
    assert server.tokens["raced"] == server.tokens["in-order"]
    assert p.transfer.num_retries == 0 and d.transfer.num_held_requests == 1
    # the node exports both counters
    run_until(server, (p, d), lambda: server.stats[d.node_id].num_held_transfers == 1)
    assert server.stats[p.node_id].num_transfer_retries == 0
    run_until(server, (p, d), lambda: p.count_unfinished() == d.count_unfinished() == 0)
    assert_idle(p, d)


def test_without_holding_the_transfer_request_is_retried(server, make_pair) -> None:
    """``max_held_requests=0``: the old handshake, "no room" until the request arrives."""
    p, d = make_pair(max_held_requests=0)
    _prefill_first(server, p, d, "retried")
    assert d.transfer.num_held_requests == 0
    server.send(d, _decode_req(p, "retried"))
    run_until(server, (p, d), lambda: "retried" in server.finished)
    assert server.finished["retried"].error is None and len(server.tokens["retried"]) == 6
    assert p.transfer.num_retries >= 1
    run_until(server, (p, d), lambda: p.count_unfinished() == d.count_unfinished() == 0)
    assert_idle(p, d)


def test_a_request_later_than_the_hold_gets_through_by_a_retry(server, make_pair) -> None:
    p, d = make_pair(handshake_timeout_s=2.0)  # held for 1 s at most
    _prefill_first(server, p, d, "late")
    end = time.monotonic() + 1.3
    while time.monotonic() < end:  # the hold ends: "no room", and the prefill node asks again
        for node in (p, d):
            node.run_once(block=False)
        time.sleep(0.005)
    assert p.transfer.num_retries >= 1
    server.send(d, _decode_req(p, "late"))
    run_until(server, (p, d), lambda: "late" in server.finished)
    assert server.finished["late"].error is None and len(server.tokens["late"]) == 6
    run_until(server, (p, d), lambda: p.count_unfinished() == d.count_unfinished() == 0)
    assert_idle(p, d)


def test_a_held_request_aborted_leaves_nothing_on_either_node(server, make_pair) -> None:
    p, d = make_pair()
    _prefill_first(server, p, d, "gone")
    server.send(p, AbortMsg(request_id="gone"))  # the server gives it up before D heard of it
    run_until(server, (p, d), lambda: d.integrity()["transfers"] == 0, max_iters=2000)
    run_until(server, (p, d), lambda: p.count_unfinished() == 0, max_iters=2000)
    assert_idle(p, d)
    assert p.integrity()["transfers"] == 0 and p.transfer.num_retries == 0
