"""The schedulers on their own, no model: admission, chunked prefill, abort in each state,
failures, counters, and the prefill and decode roles' hand-offs. A fake "forward" samples
tokens from a script."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from decode.scheduler import DecodeScheduler
from pd.cache import NoPrefixCache, RadixCache
from pd.core.kv_pool import SlotAllocator
from pd.core.request import Req, ReqStatus
from pd.core.sampling_params import SamplingParams
from pd.engine.scheduler import ScheduledBatch, Scheduler, StepResult
from pd.executor.sampler import SampledRow
from prefill.outgoing import Route
from prefill.scheduler import PrefillScheduler
from transfer.state import SlotReservation

EOS = 2
pytestmark = pytest.mark.timeout(10)


def _make_scheduler(
    cls: type[Scheduler] = Scheduler,
    *,
    num_slots: int = 256,
    page_size: int = 1,
    cache: bool = True,
    max_running: int = 8,
    budget: int = 64,
    max_model_len: int = 512,
    new_token_ratio: float = 1.0,
) -> Scheduler:
    alloc = SlotAllocator(num_slots, page_size)
    prefix_cache = RadixCache(alloc, "n") if cache else NoPrefixCache(alloc)
    return cls(
        alloc,
        prefix_cache,
        max_running_requests=max_running,
        max_prefill_tokens=budget,
        max_model_len=max_model_len,
        eos_token_ids=[EOS],
        new_token_ratio=new_token_ratio,
    )


def _req(rid: str, n: int, max_tokens: int = 8, base: int = 100, **params: object) -> Req:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)  # type: ignore[arg-type]
    return Req(rid, list(range(base, base + n)), sp)


def _run(
    s: Scheduler, token: int = 7, errors: Sequence[str] = ()
) -> tuple[ScheduledBatch, StepResult]:
    """One step with a fake forward: every row samples ``token``; rows of the requests named in
    ``errors`` fail."""
    batch = s.schedule()
    assert batch is not None, "nothing scheduled"
    rows = [
        SampledRow(-1, "boom") if r.request_id in errors else SampledRow(token) for r in batch.reqs
    ]
    return batch, s.postprocess(batch, rows)


def _drain(s: Scheduler, max_steps: int = 200) -> list[str]:
    """Step until idle; the finished request ids in order."""
    done = []
    for _ in range(max_steps):
        if not s.num_unfinished:
            return done
        _, result = _run(s)
        done += [r.request_id for r in result.produced if r.is_finished]
    raise AssertionError(f"not idle after {max_steps} steps")


def _assert_idle_and_whole(s: Scheduler) -> None:
    s.check_integrity()
    assert s.num_unfinished == 0
    assert s.allocator.num_free_slots + s.cache.num_cached_tokens == s.allocator.num_slots
    assert s.cache.num_evictable_tokens == s.cache.num_cached_tokens, "a lock outlived its request"


def test_admission_reserves_the_worst_case_and_waits_for_room() -> None:
    s = _make_scheduler(num_slots=64, cache=False)
    s.add(_req("a", 10, max_tokens=30))  # may hold 39 slots
    s.add(_req("b", 10, max_tokens=30, base=200))
    _run(s)
    assert [r.request_id for r in s.running] == ["a"] and len(s.waiting) == 1
    assert s.slots.num_available_tokens(s.running) == 64 - 39
    assert _drain(s) == ["a", "b"]
    _assert_idle_and_whole(s)


def test_max_running_requests_bounds_the_batch() -> None:
    s = _make_scheduler(max_running=2)
    for i in range(3):
        s.add(_req(f"r{i}", 4, base=100 * (i + 1)))
    batch, _ = _run(s)
    assert len(batch.reqs) == 2 and len(s.waiting) == 1


def test_chunked_prefill_under_the_token_budget_then_decode() -> None:
    s = _make_scheduler(budget=8)
    s.add(_req("a", 20, max_tokens=3))
    chunks = []
    for _ in range(3):
        batch, result = _run(s)
        assert batch.is_prefill
        chunks.append((batch.seqs[0].num_prefix, len(batch.seqs[0].new_token_ids)))
    assert chunks == [(0, 8), (8, 8), (16, 4)]
    assert [r.request_id for r in result.produced] == ["a"]  # the last chunk samples
    batch, result = _run(s)
    assert not batch.is_prefill and batch.seqs[0].num_prefix == 20
    assert list(batch.seqs[0].new_token_ids) == [7]
    assert _drain(s) == ["a"]
    _assert_idle_and_whole(s)


def test_a_new_prompt_is_prefilled_beside_the_running_decodes() -> None:
    s = _make_scheduler(budget=64)
    s.max_mixed_prefill_tokens = 6
    s.add(_req("a", 4))
    _run(s)
    s.add(_req("b", 10, base=300))
    batch, _ = _run(s)  # a decodes, b gets the mixed budget
    assert [r.request_id for r in batch.reqs] == ["a", "b"] and batch.num_decode == 1
    assert [len(q.new_token_ids) for q in batch.seqs] == [1, 6]
    batch, _ = _run(s)
    assert [len(q.new_token_ids) for q in batch.seqs] == [1, 4]


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding"])
def test_abort_in_each_state_releases_everything(state: str) -> None:
    s = _make_scheduler(budget=8, max_running=1)
    s.add(_req("a", 20))
    s.add(_req("b", 4, base=300))
    steps = {"waiting": 1, "prefilling": 1, "decoding": 4}[state]
    for _ in range(steps):
        _run(s)
    victim = "b" if state == "waiting" else "a"
    req = s.abort(victim)
    assert req is not None and req.finish_reason == "abort" and req.slots == []
    assert s.abort(victim) is None and s.abort("unknown") is None
    s.check_integrity()
    _drain(s)
    _assert_idle_and_whole(s)
    if state != "waiting":  # what it computed stays cached for the next request
        assert s.cache.num_cached_tokens >= 16


def test_a_failed_sample_fails_its_request_alone() -> None:
    s = _make_scheduler()
    s.add(_req("a", 4))
    s.add(_req("b", 4, base=300))
    _, result = _run(s, errors=["a"])
    assert [r.request_id for r in result.failed] == ["a"]
    assert [r.request_id for r in result.produced] == ["b"]
    assert result.failed[0].error == "boom" and result.failed[0].finish_reason == "abort"
    assert [r.request_id for r in s.running] == ["b"]
    assert _drain(s) == ["b"]
    _assert_idle_and_whole(s)


def test_a_failed_forward_releases_the_batch() -> None:
    s = _make_scheduler()
    s.add(_req("a", 4))
    s.add(_req("b", 4, base=300))
    batch = s.schedule()
    assert batch is not None
    failed = s.fail_batch(batch, "forward failed: x")
    assert {r.request_id for r in failed} == {"a", "b"}
    assert all(r.error == "forward failed: x" for r in failed)
    _assert_idle_and_whole(s)


@pytest.mark.parametrize(
    ("params", "tokens", "reason", "n_out"),
    [
        ({}, [5, EOS], "stop", 2),
        ({"ignore_eos": True, "max_tokens": 3}, [EOS, EOS, EOS], "length", 3),
        ({"stop_token_ids": (9,)}, [5, 9], "stop", 2),
        ({"max_tokens": 2}, [5, 5], "length", 2),
    ],
)
def test_finish_reasons(params: dict, tokens: list[int], reason: str, n_out: int) -> None:
    s = _make_scheduler()
    p = {"max_tokens": 8, **params}
    req = _req("a", 4, **p)  # type: ignore[arg-type]
    s.add(req)
    for t in tokens:
        _run(s, token=t)
    assert req.finish_reason == reason and len(req.output_ids) == n_out
    _assert_idle_and_whole(s)


def test_context_length_ends_a_request_and_bad_requests_are_refused() -> None:
    s = _make_scheduler(max_model_len=8, num_slots=16)
    req = _req("a", 6, max_tokens=2)
    s.add(req)
    _drain(s)
    assert req.finish_reason == "length" and len(req.all_ids) == 8
    with pytest.raises(ValueError, match=r"prompt \(6 tokens\) \+ max_tokens \(3\) = 9"):
        s.add(_req("b", 6, max_tokens=3))
    with pytest.raises(ValueError, match="prompt is empty"):
        s.add(_req("c", 0))
    big = _make_scheduler(num_slots=16, max_model_len=64)
    with pytest.raises(ValueError, match="needs 20 KV slots, the pool has 16"):
        big.add(_req("d", 10, max_tokens=11))


def test_counters_count_prompt_and_cached_tokens() -> None:
    s = _make_scheduler(page_size=4)
    s.add(_req("a", 17))
    _drain(s)
    s.add(_req("b", 17))  # same prompt: 16 of 17 - 1 tokens, page-aligned, come from the cache
    s.add(_req("c", 9, base=900))
    stats = s.stats()
    assert (stats.num_waiting, stats.num_running, stats.num_queued_tokens) == (2, 0, 26)
    _run(s)
    stats = s.stats()
    assert stats.num_prompt_tokens == 17 + 17 + 9
    assert stats.num_cached_tokens == 16
    assert stats.num_running == 2 and stats.num_queued_tokens == 0
    _drain(s)
    _assert_idle_and_whole(s)


_ROUTE = Route("tcp://127.0.0.1:9", "tcp://127.0.0.1:9")


def _add_routed(s: PrefillScheduler, req: Req) -> None:
    """As a prefill node adds a request: its outgoing record, then the scheduler's queue."""
    s.outgoing.add(req, _ROUTE)
    s.add(req)


def test_prefill_role_reserves_the_prompt_and_hands_off_after_the_first_token() -> None:
    s = _make_scheduler(PrefillScheduler, num_slots=32, page_size=4)
    assert isinstance(s, PrefillScheduler)
    _add_routed(s, _req("a", 14, max_tokens=400))  # max_tokens costs a prefill node nothing
    _add_routed(s, _req("once", 6, max_tokens=1, base=500))
    _, result = _run(s)
    assert {r.request_id for r in result.produced} == {"a", "once"}
    sent = [o.req for o in s.outgoing.take_prefilled()]
    assert [r.request_id for r in sent] == ["a"] and s.outgoing.take_prefilled() == []
    assert s.running == [] and len(s.outgoing.sending()) == 1 and s.num_unfinished == 1
    # a's KV may be on the wire: its slots stay its own until the transfer ends
    assert s.cache.num_cached_tokens == 4  # "once" finished: its aligned prompt is cached
    assert s.allocator.num_used_slots == 16 + 4
    s.check_integrity()
    s.outgoing.finish("once", "finished at prefill")  # the node forgets it
    out = s.outgoing.finish_sending("a")
    assert out is sent[0] and s.outgoing.finish_sending("a") is None
    _assert_idle_and_whole(s)
    assert len(s.outgoing) == 0
    assert s.cache.num_cached_tokens == 16  # the prompt stays cached, unlocked


def test_prefill_role_abort_while_sending() -> None:
    s = _make_scheduler(PrefillScheduler)
    assert isinstance(s, PrefillScheduler)
    req = _req("a", 10)
    _add_routed(s, req)
    _run(s)
    assert s.outgoing.abort("a") and not s.outgoing.abort("a")
    assert req.finish_reason == "abort"
    assert s.outgoing.take_prefilled() == [] and len(s.outgoing) == 0
    _assert_idle_and_whole(s)


def test_decode_role_reserves_incoming_kv_and_decodes_it() -> None:
    s = _make_scheduler(DecodeScheduler, num_slots=64, page_size=4)
    assert isinstance(s, DecodeScheduler)
    s.add(_req("warm", 13, max_tokens=1))  # leaves 12 prompt tokens cached
    _drain(s)
    a = _req("a", 13, max_tokens=20)
    s.incoming.expect(a, "prefill-0")
    res = s.incoming.reserve("a", 13, None)
    assert res is not None and res.num_cached_tokens == 12 and len(res.slots) == 1
    assert len(s.incoming) == 1 and s.num_unfinished == 1
    # a's 32 slots (prompt 13 + 19 to decode, in pages) are promised: b cannot fit beside it
    b = _req("b", 30, max_tokens=8, base=400)
    s.incoming.expect(b, "prefill-0")
    assert s.incoming.reserve("b", 30, None) is None
    assert s.cache.num_protected_tokens == 12, "a refused reservation must lock nothing"
    s.check_integrity()
    assert s.incoming.admit("a", 11) is None  # its KV has not landed yet
    s.incoming.landed("a")
    assert s.incoming.admit("a", 11) is a and a.output_ids == [11]
    assert s.incoming.admit("a", 11) is None
    assert s.incoming.ids() == ["b"] and s.incoming.forget_peer("prefill-0") == ["b"]
    assert _drain(s) == ["a"] and len(a.output_ids) == 20
    _assert_idle_and_whole(s)


def test_decode_role_releases_a_reservation_whose_kv_never_comes() -> None:
    s = _make_scheduler(DecodeScheduler)
    assert isinstance(s, DecodeScheduler)
    a = _req("a", 10)
    assert not s.incoming.knows("a")
    with pytest.raises(ValueError, match="'a' is not expected here"):
        s.incoming.reserve("a", 10, None)
    s.incoming.expect(a, "prefill-0")
    assert s.incoming.knows("a") and s.incoming.reserve("a", 10, None) is not None
    with pytest.raises(ValueError, match="'a' is not expected here"):
        s.incoming.reserve("a", 10, None)
    with pytest.raises(ValueError, match="already has a reservation"):
        s.reserve_incoming(a, 10)
    b = _req("b", 10)
    s.incoming.expect(b, "prefill-0")
    with pytest.raises(ValueError, match="transfer of 9 tokens for a 10-token prompt"):
        s.incoming.reserve("b", 9, None)
    assert b.status is ReqStatus.FINISHED and not s.incoming.knows("b")  # failed alone
    assert [f.request_id for f in s.incoming.take_failed()] == ["b"]
    s.incoming.release("a", SlotReservation(a.slots, 0))
    assert a.status is ReqStatus.FINISHED and a.finish_reason == "abort"
    assert [f.can_retry for f in s.incoming.take_failed()] == [True]  # the server may retry it
    _assert_idle_and_whole(s)


def test_optimistic_admission_runs_more_requests_than_the_worst_case_allows() -> None:
    worst = _make_scheduler(num_slots=64, cache=False)
    optimistic = _make_scheduler(num_slots=64, cache=False)
    optimistic.slots.new_token_ratio = optimistic.slots.init_new_token_ratio = 0.7
    for s in (worst, optimistic):
        for i in range(3):
            s.add(_req(f"r{i}", 10, max_tokens=30, base=100 * (i + 1)))
        _run(s)
    assert len(worst.running) == 1  # 39 slots each at worst: one fits in 64
    assert len(optimistic.running) == 2  # 10 + 0.7 * 30 = 31 expected each


def test_a_pool_too_small_for_all_running_requests_retracts_and_resumes() -> None:
    s = _make_scheduler(num_slots=64, page_size=4)
    s.slots.new_token_ratio = s.slots.init_new_token_ratio = 0.3
    reqs = [_req(f"r{i}", 10, max_tokens=40, base=100 * (i + 1)) for i in range(3)]
    for r in reqs:
        s.add(r)
    peak = 0
    for _ in range(400):
        if not s.num_unfinished:
            break
        _run(s, token=5 + len(s.running))
        s.check_integrity()
        peak = max(peak, len(s.running))
    assert all(r.finish_reason == "length" and len(r.output_ids) == 40 for r in reqs)
    assert peak >= 2 and s.stats().num_retracted >= 1
    resumed = [r for r in reqs if r.num_admissions > 1]
    assert resumed and all(r.fill_len > r.num_prompt_tokens for r in resumed)
    # what a resumed request computed before its retraction came back from the cache
    assert s.cache.stats.num_hit_tokens > 0
    _assert_idle_and_whole(s)


def test_reserving_the_worst_case_never_retracts() -> None:
    s = _make_scheduler(num_slots=64, page_size=4)  # new_token_ratio 1.0
    for i in range(3):
        s.add(_req(f"r{i}", 10, max_tokens=40, base=100 * (i + 1)))
    _drain(s)
    assert s.stats().num_retracted == 0
    _assert_idle_and_whole(s)


def test_a_request_without_max_tokens_does_not_lower_the_batch() -> None:
    """At pd's defaults (32768 slots, ratio 0.7) and SmolLM2's 8192-token context, eight chat
    requests of ~620 tokens run at once whether they set max_tokens or leave it to the server,
    which fills in the rest of the context; reserving that worst case ran four."""
    ctx, prompt_len, n = 8192, 620, 8

    def num_running(max_tokens: int, ratio: float) -> int:
        s = _make_scheduler(
            num_slots=32768, cache=False, max_running=64, budget=16384, max_model_len=ctx
        )
        s.slots.new_token_ratio = s.slots.init_new_token_ratio = ratio
        for i in range(n):
            s.add(_req(f"r{i}", prompt_len, max_tokens=max_tokens, base=1000 * (i + 1)))
        _run(s)
        return len(s.running)

    assert n > 32768 // ctx  # more than reserving prompt + max_tokens allows
    assert num_running(32, 0.7) == n
    assert num_running(ctx - prompt_len, 0.7) == n


def _sharing(rid: str, leader: Req, num_shared: int, n_own: int, **kw: object) -> Req:
    """A request whose prompt is ``leader``'s first ``num_shared`` tokens, then its own."""
    sp = SamplingParams(max_tokens=4, temperature=0.0)
    own = list(range(900, 900 + n_own))
    return Req(rid, leader.prompt_ids[:num_shared] + own, sp, **kw)  # type: ignore[arg-type]


def test_a_request_sharing_an_uncached_prefix_waits_for_it_and_others_go_first() -> None:
    s = _make_scheduler(budget=512)
    leader = _req("a", 100, max_tokens=4)
    s.add(leader)
    s.add(_sharing("b", leader, 80, 20))  # 80 shared tokens, none cached yet
    s.add(_req("c", 30, base=5000))  # unrelated: goes ahead of b
    s.add(_sharing("short", leader, 31, 20))  # one token short of deferral.MIN_DEFERRED_SHARED_TOKENS
    batch, _ = _run(s)
    assert [r.request_id for r in batch.reqs] == ["a", "c", "short"]
    assert [r.request_id for r in s.waiting] == ["b"]
    # a's prompt went into the cache at its first token: b now computes only its own 20
    batch, _ = _run(s)
    b = next(r for r in batch.reqs if r.request_id == "b")
    assert b.num_cached_tokens == 80
    assert len(batch.seqs[batch.reqs.index(b)].new_token_ids) == 20
    assert sorted(_drain(s)) == ["a", "b", "c", "short"]
    _assert_idle_and_whole(s)


def test_a_prompt_is_cached_at_its_first_token_and_matched_while_it_decodes() -> None:
    s = _make_scheduler(page_size=4)
    a = _req("a", 14, max_tokens=20)
    s.add(a)
    _run(s)  # a's prefill and first token
    assert s.cache.num_cached_tokens == 12  # its aligned prompt, locked while it runs
    assert s.cache.num_evictable_tokens == 0
    s.check_integrity()
    _run(s)
    s.add(_sharing("b", a, 14, 6))
    batch, _ = _run(s)
    assert [r.request_id for r in batch.reqs] == ["a", "b"]  # a still decodes
    assert batch.reqs[1].num_cached_tokens == 12
    s.check_integrity()
    assert sorted(_drain(s)) == ["a", "b"]
    _assert_idle_and_whole(s)


def test_another_namespace_neither_waits_nor_matches() -> None:
    s = _make_scheduler(budget=512)
    leader = _req("a", 100)
    s.add(leader)
    s.add(_sharing("b", leader, 80, 20, namespace="tenant-2"))
    batch, _ = _run(s)
    assert [r.request_id for r in batch.reqs] == ["a", "b"]
    assert batch.reqs[1].num_cached_tokens == 0
    assert sorted(_drain(s)) == ["a", "b"]
    _assert_idle_and_whole(s)


def test_prefill_role_defers_to_a_prompt_being_sent_until_its_transfer_ends() -> None:
    s = _make_scheduler(PrefillScheduler, budget=512)
    assert isinstance(s, PrefillScheduler)
    leader = _req("a", 100)
    _add_routed(s, leader)
    _run(s)
    assert [o.req.request_id for o in s.outgoing.take_prefilled()] == ["a"]
    _add_routed(s, _sharing("b", leader, 80, 20))
    assert s.schedule() is None  # a's slots may be on the wire: not cached, b waits
    assert [r.request_id for r in s.waiting] == ["b"]
    s.outgoing.finish_sending("a")
    batch, _ = _run(s)
    assert [r.request_id for r in batch.reqs] == ["b"] and batch.reqs[0].num_cached_tokens == 80
    s.outgoing.finish_sending("b")
    _assert_idle_and_whole(s)


def test_decode_role_caches_a_transferred_prompt_when_it_is_admitted() -> None:
    s = _make_scheduler(DecodeScheduler, num_slots=64, page_size=4)
    assert isinstance(s, DecodeScheduler)
    a = _req("a", 14, max_tokens=6)
    s.incoming.expect(a, "prefill-0")
    assert s.incoming.reserve("a", 14, None) is not None
    assert s.cache.num_cached_tokens == 0
    s.incoming.landed("a")
    s.incoming.admit("a", 7)
    assert s.cache.num_cached_tokens == 12 and s.cache.num_evictable_tokens == 0
    s.add(_sharing("b", a, 14, 3))
    batch, _ = _run(s)
    assert [r.request_id for r in batch.reqs] == ["a", "b"]
    assert batch.reqs[1].num_cached_tokens == 12
    assert sorted(_drain(s)) == ["a", "b"]
    _assert_idle_and_whole(s)


def test_thirty_two_requests_without_max_tokens_run_on_one_decode_node() -> None:
    """32 chat requests without max_tokens (the server gives each the rest of SmolLM2's
    8,192-token context) on one decode node of pd's default 32,768 slots, half of them
    prefilled by a prefill node and half here: every one is taken at once. Expecting
    ``new_token_ratio`` of the whole context (clipped to 4,096) took 10 (3,268 slots each);
    now a request is expected to run 512 tokens, or as many again as it ran, so the node is
    bounded by the KV answers use. As they decode, the expectations grow with them."""
    ctx, prompt_len, n = 8192, 400, 32
    s = _make_scheduler(
        DecodeScheduler, num_slots=32768, cache=False, max_running=64, budget=16384,
        max_model_len=ctx, new_token_ratio=0.7,  # pd's default
    )  # fmt: skip
    assert isinstance(s, DecodeScheduler)
    reqs = [
        _req(f"r{i}", prompt_len, max_tokens=ctx - prompt_len, base=1000 * (i + 1))
        for i in range(n)
    ]
    for r in reqs[: n // 2]:  # their KV comes from a prefill node
        s.incoming.expect(r, "prefill-0")
        assert s.incoming.reserve(r.request_id, prompt_len, None) is not None, r.request_id
        s.incoming.landed(r.request_id)
        assert s.incoming.admit(r.request_id, 7) is r
    for r in reqs[n // 2 :]:  # prefilled here
        s.add(r)
    _run(s)
    assert len(s.running) == n and not s.waiting
    ratio = s.slots.new_token_ratio  # decays a little each decode step
    assert s.slots.expected_len(reqs[0]) == prompt_len + 1 + math.ceil(512 * ratio)
    for _ in range(20):
        _run(s)
        s.check_integrity()
    ratio = s.slots.new_token_ratio
    assert s.slots.expected_len(reqs[0]) == prompt_len + 21 + math.ceil(512 * ratio)
    assert s.stats().num_retracted == 0
    for r in reqs:
        s.abort(r.request_id)
    _assert_idle_and_whole(s)


def test_an_answer_that_outruns_its_expectation_is_expected_to_run_as_long_again() -> None:
    """Past 512 tokens a request is expected to generate as many again as it has (its
    max_tokens caps it); a request with a small max_tokens is expected to use all of it."""
    s = _make_scheduler(num_slots=8192, cache=False, max_model_len=8192)
    long = _req("long", 100, max_tokens=8000)
    assert s.slots.expected_len(long) == 100 + 512
    long.output_ids = [7] * 1000
    long.fill_len = 1100
    assert s.slots.expected_len(long) == 1100 + 1000
    long.output_ids = [7] * 5000
    long.fill_len = 5100
    assert s.slots.expected_len(long) == long.max_len == 100 + 8000 - 1  # max_tokens caps it
    assert s.slots.expected_len(_req("short", 100, max_tokens=30)) == 100 + 30 - 1


@pytest.mark.parametrize("cls", [Scheduler, PrefillScheduler, DecodeScheduler])
def test_waiting_is_ordered_by_priority_then_arrival_and_overtaking_is_bounded(cls) -> None:
    """With one running place: a priority -1 request runs before earlier priority 0 ones, and
    a stream of better priorities overtakes a waiting request MAX_OVERTAKES times at most."""
    from pd.core.priority import MAX_OVERTAKES

    s = _make_scheduler(cls, max_running=1, num_slots=4096)
    for i, (rid, prio) in enumerate([("a", 0), ("b", 0), ("urgent", -1), ("c", 0)]):
        s.add(_req(rid, 4, base=100 + 10 * i, priority=prio))
    assert [r.request_id for r in s.waiting] == ["urgent", "a", "b", "c"]
    s.waiting.clear()
    s.add(_req("low", 4, priority=3))
    for i in range(MAX_OVERTAKES + 5):
        s.add(_req(f"hi{i}", 4, base=200 + 10 * i, priority=-1))
    ids = [r.request_id for r in s.waiting]
    assert ids.index("low") == MAX_OVERTAKES
