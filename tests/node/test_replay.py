"""What a node answers to ``ResendMsg`` (``pd.node.replay``), and that its record of finished
requests stays bounded. No model, no sockets."""

from __future__ import annotations

from pd.core.messages import ResendMsg, TokenLogprobsMsg, TokenMsg, token_bytes
from pd.core.request import Req
from pd.core.sampling_params import SamplingParams
from pd.node.replay import RecentOutputs, answer, split


def _req(rid: str, outputs: list[int], finish: str | None = None, logprobs: bool = False) -> Req:
    req = Req(rid, [1, 2, 3], SamplingParams(max_tokens=100, logprobs=1 if logprobs else None))
    req.output_ids = list(outputs)
    req.output_logprobs = [TokenLogprobsMsg(t, -1.0 * t) for t in outputs] if logprobs else []
    req.finish_reason = finish
    req.num_cached_tokens = 2
    return req


def _ask(rid: str, start: int) -> ResendMsg:
    return ResendMsg(request_id=rid, from_offset=start)


def test_a_live_request_is_answered_from_its_output_and_one_without_any_with_none() -> None:
    recent = RecentOutputs()
    live = _req("r", [10, 11, 12, 13], logprobs=True)
    live.num_reported_cached_tokens = 1  # the prefill node's hit, as its first token said
    msg = answer(_ask("r", 1), live, False, True, recent, "decode-0")
    assert (msg.offset, msg.token_ids, msg.finished) == (1, [11, 12, 13], False)
    assert [lp.token_id for lp in msg.logprobs] == [11, 12, 13]
    assert msg.num_cached_tokens == 1 and msg.num_prompt_tokens == 3
    # waiting, expected, or on a node that does not stream it (a prefill node): no tokens
    for live_, held, streams in ((None, True, True), (live, False, False)):
        msg = answer(_ask("r", 0), live_, held, streams, recent, "n")
        assert (msg.offset, msg.token_ids, msg.finished, msg.error) == (0, [], False, None)


def test_a_finished_request_is_answered_from_the_record_and_an_unknown_one_with_an_error() -> None:
    recent = RecentOutputs(window=3)
    recent.add_finished(_req("r", [10, 11, 12, 13, 14], finish="length", logprobs=True))
    msg = answer(_ask("r", 3), None, False, True, recent, "decode-0")
    assert (msg.offset, msg.token_ids, msg.finished, msg.finish_reason) == (3, [13, 14], True,
                                                                           "length")  # fmt: skip
    assert [lp.token_id for lp in msg.logprobs] == [13, 14] and msg.error is None
    assert answer(_ask("r", 5), None, False, True, recent, "d").token_ids == []  # only the end
    for rid, start in (("r", 1), ("nobody", 0)):  # before the window kept; never known
        msg = answer(_ask(rid, start), None, False, True, recent, "decode-0")
        assert msg.is_unknown and msg.finished and msg.error is not None
        assert f"cannot send tokens from offset {start} of request {rid}" in msg.error
    assert "it keeps tokens 2-5" in answer(_ask("r", 1), None, False, True, recent, "d").error


def test_a_resumed_request_answers_with_the_logprobs_it_made_here() -> None:
    """A failover brought it 3 tokens (their logprobs stayed at the server): it made 2 more."""
    live = _req("r", [10, 11, 12, 13, 14], logprobs=True)
    live.num_resumed, live.output_logprobs = 3, live.output_logprobs[3:]
    msg = answer(_ask("r", 4), live, False, True, RecentOutputs(), "decode-1")
    assert (msg.offset, msg.token_ids, [lp.token_id for lp in msg.logprobs]) == (4, [14], [14])
    msg = answer(_ask("r", 1), live, False, True, RecentOutputs(), "decode-1")
    assert (msg.offset, msg.token_ids, msg.logprobs) == (1, [], [])  # the server has those
    recent = RecentOutputs(window=4)
    live.finish_reason = "length"
    recent.add_finished(live)
    msg = answer(_ask("r", 3), None, False, True, recent, "decode-1")
    assert (msg.token_ids, [lp.token_id for lp in msg.logprobs]) == ([13, 14], [13, 14])


def test_a_failed_request_is_answered_with_its_error_again() -> None:
    recent = RecentOutputs()
    err = TokenMsg(request_id="r", offset=0, token_ids=[], finished=True, finish_reason="abort",
                   num_prompt_tokens=0, num_cached_tokens=0, error="KV transfer failed",
                   can_retry=True)  # fmt: skip
    recent.add_error(err)
    msg = answer(_ask("r", 0), None, False, True, recent, "p")
    assert msg.error == "KV transfer failed" and msg.can_retry and not msg.is_unknown


def test_the_record_is_bounded_in_ids_age_and_tokens_each() -> None:
    now = [0.0]
    recent = RecentOutputs(max_ids=3, max_age_s=10.0, window=4, clock=lambda: now[0])
    for i in range(5):
        recent.add_finished(_req(f"r{i}", list(range(100)), finish="length"))
    assert len(recent) == 3 and recent.get("r0") is None and recent.get("r4") is not None
    ended = recent.get("r4")
    assert ended is not None and (ended.offset, ended.token_ids) == (96, [96, 97, 98, 99])
    now[0] = 11.0
    assert recent.get("r4") is None and len(recent) == 0


def test_a_long_answer_goes_in_messages_each_within_its_bytes() -> None:
    recent = RecentOutputs()
    live = _req("r", list(range(1000)), logprobs=True)
    whole = answer(_ask("r", 10), live, False, True, recent, "decode-0")
    parts = split(whole, max_bytes=2000)
    assert len(parts) > 1 and all(token_bytes(len(m.token_ids), m.logprobs) <= 2000 for m in parts)
    assert [m.offset for m in parts] == [10 + sum(len(m.token_ids) for m in parts[:i])
                                         for i in range(len(parts))]  # fmt: skip
    assert [t for m in parts for t in m.token_ids] == list(range(10, 1000))
    assert [lp.token_id for m in parts for lp in m.logprobs] == list(range(10, 1000))
    recent.add_finished(_req("f", list(range(100)), finish="stop"))
    parts = split(answer(_ask("f", 40), None, False, True, recent, "d"), max_bytes=100)
    assert [m.finished for m in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].finish_reason == "stop" and parts[0].finish_reason is None
    assert split(answer(_ask("nobody", 0), None, False, True, recent, "d"))[0].is_unknown


def test_the_record_of_logprob_answers_stays_within_its_bytes() -> None:
    """One tenant's short ``n=16``, ``top_logprobs=20`` requests fill the record's 4,096 ends
    within its 120 s: held as objects, their logprobs took ~120 KB an end (~480 MiB a node);
    held as msgpack and bounded in bytes, the record stays under ``max_bytes``."""
    import gc
    import random
    import tracemalloc

    rng = random.Random(0)

    def lp(token: int) -> TokenLogprobsMsg:
        ids = [rng.randrange(49152) for _ in range(20)]
        return TokenLogprobsMsg(token, -rng.random(), ids, [-rng.random() for _ in ids])

    recent = RecentOutputs()  # the node's defaults
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(1024):
            req = _req(f"r{i}", list(range(64)), finish="length")
            req.output_logprobs = [lp(t) for t in req.output_ids]
            recent.add_finished(req)
            del req
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 20 << 20, f"{held / 2**20:.0f} MiB held by the record"  # 16 MiB, and slack
    assert recent.num_bytes <= recent.max_bytes == 16 << 20, recent.num_bytes
    assert 0 < len(recent) < 1024  # the oldest went first
    newest = answer(_ask("r1023", 60), None, False, True, recent, "d")
    assert newest.token_ids == [60, 61, 62, 63] and len(newest.logprobs[0].top_ids) == 20
