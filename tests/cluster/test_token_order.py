"""Offsets on the token path (``pd.cluster.token_order``): the arithmetic of ``take_new``, and
``ClusterClient`` against fake nodes (their real sockets, driven by the test) that send token
frames twice, skip some, or go silent: the answer is whole, or ends at once with an error
naming the lost tokens. No model, no Ray."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from pd.cluster.flights import ClusterError
from pd.cluster.token_order import Order, take_new
from pd.core.messages import (
    AbortMsg,
    DecodeReqMsg,
    PrefillReqMsg,
    ResendMsg,
    TokenLogprobsMsg,
    TokenMsg,
)
from pd.core.sampling_params import SamplingParams
from pd.server.metrics import ServerMetrics
from tests.cluster.test_client import FakeNode, Harness, _harness, _token_msg, _until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _msg(offset: int, ids: list[int], finished: bool = False, logprobs: bool = False) -> TokenMsg:
    msg = _token_msg("r", ids, node_id="decode-0", finished=finished, reason=None)
    lps = [TokenLogprobsMsg(t, -float(t)) for t in ids] if logprobs else []
    return msgspec.structs.replace(msg, offset=offset, logprobs=lps)


def test_take_new_sorts_each_message_against_what_the_server_has() -> None:
    assert take_new(0, _msg(0, [5, 6])) == (Order.NEW, [5, 6], [])
    assert take_new(2, _msg(2, [7])) == (Order.NEW, [7], [])
    # wholly before: a duplicate (also one ending exactly where the server is)
    assert take_new(3, _msg(0, [5, 6])).order is Order.DUPLICATE
    assert take_new(3, _msg(1, [6, 7])).order is Order.DUPLICATE
    # overlapping: only the new tail, tokens and logprobs alike
    taken = take_new(3, _msg(1, [6, 7, 8, 9], logprobs=True))
    assert taken.order is Order.NEW and taken.token_ids == [8, 9]
    assert [lp.token_id for lp in taken.logprobs] == [8, 9]
    # after it: tokens were lost
    assert take_new(3, _msg(4, [9])).order is Order.GAP
    assert take_new(3, _msg(5, [], finished=True)).order is Order.GAP
    # nothing new but the end: the end is taken; a message without tokens where the server is
    # (a probe's answer) is nothing new, not a duplicate
    assert take_new(3, _msg(1, [6, 7], finished=True)) == (Order.NEW, [], [])
    assert take_new(3, _msg(3, [], finished=True)) == (Order.NEW, [], [])
    assert take_new(3, _msg(3, [])) == (Order.NEW, [], [])
    assert take_new(3, _msg(0, [5], finished=True)).order is Order.DUPLICATE  # ends short


def test_a_token_message_refuses_a_negative_offset_or_logprobs_out_of_step() -> None:
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(TokenMsg)
    raw = msgspec.msgpack.decode(enc.encode(_msg(0, [5, 6], logprobs=True)))
    with pytest.raises(msgspec.ValidationError, match="offset -1"):
        dec.decode(enc.encode({**raw, "offset": -1}))
    with pytest.raises(msgspec.ValidationError, match="2 tokens, 1 logprobs"):
        dec.decode(enc.encode({**raw, "logprobs": raw["logprobs"][:1]}))
    with pytest.raises(ValueError, match="offset -2"):
        ResendMsg(request_id="r", from_offset=-2)


async def _streaming(h: Harness, rid: str = "r1") -> tuple[FakeNode, FakeNode]:
    p, d = h.add("prefill-0"), h.add("decode-0")
    h.request(rid)
    assert (await d.recv_until(DecodeReqMsg)).request_id == rid
    assert (await p.recv_until(PrefillReqMsg)).request_id == rid
    return p, d


async def test_duplicated_and_overlapping_frames_are_dropped_and_counted() -> None:
    async with _harness() as h:
        _, d = await _streaming(h)
        d.tokens("r1", [5], offset=0)
        d.tokens("r1", [5], offset=0)  # twice
        d.tokens("r1", [6, 7], offset=1)
        d.tokens("r1", [6], offset=1)  # a late one, out of order
        d.tokens("r1", [7, 8], offset=2)  # overlaps: 8 is new
        d.tokens("r1", [9], offset=4, finished=True)
        d.tokens("r1", [9], offset=4, finished=True)  # after the end: its attempt is gone
        await h.wait_done("r1")
        assert "r1" not in h.errors and h.tokens_of("r1") == [5, 6, 7, 8, 9]
        assert h.client.flights.resends.num_duplicates == 2
        metrics = ServerMetrics()
        metrics.update_stats(h.client.stats())
        assert "pd_server_duplicate_token_messages 2.0" in metrics.render().decode()


async def test_a_gap_has_the_node_send_the_output_again_from_what_the_server_has() -> None:
    async with _harness() as h:
        _, d = await _streaming(h)
        d.tokens("r1", [5], offset=0)
        d.tokens("r1", [7], offset=2)  # 6 was lost
        ask = await d.recv_until(ResendMsg)
        assert ask == ResendMsg(request_id="r1", from_offset=1)
        d.tokens("r1", [8], offset=3)  # sent before the ask came: a gap too, not asked again
        d.tokens("r1", [6, 7, 8], offset=1)  # the answer
        d.tokens("r1", [9], offset=4, finished=True)
        await h.wait_done("r1")
        assert "r1" not in h.errors and h.tokens_of("r1") == [5, 6, 7, 8, 9]
        assert h.client.flights.resends.num_gaps == 2
        assert h.client.flights.resends.num_asked == 1


async def test_a_lost_last_frame_is_asked_for_after_a_silence() -> None:
    async with _harness(token_probe_s=0.3) as h:
        _, d = await _streaming(h)
        d.tokens("r1", [5, 6], offset=0)
        start = time.monotonic()
        ask = await d.recv_until(ResendMsg)  # the last frame, [7], was lost
        assert ask == ResendMsg(request_id="r1", from_offset=2)
        assert time.monotonic() - start >= 0.25
        d.tokens("r1", [7], offset=2, finished=True)
        await h.wait_done("r1")
        assert "r1" not in h.errors and h.tokens_of("r1") == [5, 6, 7]


async def test_a_silent_request_its_node_still_holds_is_left_to_run() -> None:
    async with _harness(token_probe_s=0.2) as h:
        _, d = await _streaming(h)
        d.tokens("r1", [5], offset=0)
        for _ in range(3):  # paused there, say: each probe is answered without tokens
            assert await d.recv_until(ResendMsg) == ResendMsg(request_id="r1", from_offset=1)
            d.tokens("r1", [], offset=1)
        d.tokens("r1", [6], offset=1, finished=True)
        await h.wait_done("r1")
        assert "r1" not in h.errors and h.tokens_of("r1") == [5, 6]


async def test_tokens_the_node_no_longer_holds_end_the_request_at_once() -> None:
    async with _harness(token_probe_s=0.2) as h:
        _, d = await _streaming(h)
        d.tokens("r1", [5], offset=0)
        await d.recv_until(ResendMsg)
        lost = "node decode-0 cannot send tokens from offset 1 of request r1 again"
        unknown = _token_msg("r1", [], node_id="decode-0", finished=True, reason="abort",
                             error=lost)  # fmt: skip
        d.send(msgspec.structs.replace(unknown, offset=1, is_unknown=True))
        await h.wait_done("r1")  # within seconds, not at its deadline (600 s)
        assert isinstance(h.errors["r1"], ClusterError) and lost in str(h.errors["r1"])
        assert isinstance(await d.recv_until(AbortMsg), AbortMsg)  # its node drops it too


async def test_before_its_first_token_both_nodes_are_asked_and_both_must_not_know_it() -> None:
    async with _harness(token_probe_s=0.2) as h:
        p, d = await _streaming(h)
        # each probe goes to both nodes of the attempt
        assert await p.recv_until(ResendMsg) == ResendMsg(request_id="r1", from_offset=0)
        assert await d.recv_until(ResendMsg) == ResendMsg(request_id="r1", from_offset=0)

        def unknown(node: FakeNode) -> None:
            msg = _token_msg("r1", [], node_id=node.node_id, finished=True, reason="abort",
                             error=f"{node.node_id} lost it")  # fmt: skip
            node.send(msgspec.structs.replace(msg, is_unknown=True))

        unknown(d)  # not there yet, or told to forget it: the prefill node may hold it
        p.tokens("r1", [], offset=0)  # still prefilling
        await asyncio.sleep(0.1)
        assert "r1" not in h.errors and not h.tasks["r1"].done()
        await p.recv_until(ResendMsg)
        unknown(p)  # now neither holds it
        await h.wait_done("r1")
        assert isinstance(h.errors["r1"], ClusterError)
        assert "prefill-0 lost it" in str(h.errors["r1"])


async def test_a_request_that_ends_at_its_first_token_is_answered_again_by_its_prefill_node() -> (
    None
):
    async with _harness(token_probe_s=0.2) as h:
        p, _ = h.add("prefill-0"), h.add("decode-0")
        h.request("r1", SamplingParams(max_tokens=1, temperature=0.0))
        await p.recv_until(PrefillReqMsg)
        # its one frame from the prefill node was lost; a probe reaches both nodes
        assert await p.recv_until(ResendMsg) == ResendMsg(request_id="r1", from_offset=0)
        p.tokens("r1", [42], offset=0, finished=True)
        await h.wait_done("r1")
        assert "r1" not in h.errors and h.tokens_of("r1") == [42]
        await _until(lambda: not h.client.coordinator._requests)
