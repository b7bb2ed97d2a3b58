"""Speculative decoding in the engine (``Drafter``, ``ModelRunner.run``): the same
greedy output as without it, drafts cut at max_tokens and stop tokens, every draft slot back
when proposals are rejected, and the counters."""

from __future__ import annotations

import pytest
import torch

from pd.core.kv_pool import SlotAllocator
from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig


def _engine(model_dir, **kw) -> Engine:
    kw.setdefault("max_total_tokens", 4096)
    return Engine(EngineConfig(model=str(model_dir), **kw))


def _prompt(seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (20 + seed,), generator=g).tolist()


def _oracle(monkeypatch, prompts, outputs, vocab: int, wrong_at: int | None) -> None:
    """Replace the n-gram proposer (a random model repeats nothing for it to find) with one
    that drafts each request's true greedy continuation, wrong at draft position
    ``wrong_at``: the drafts are accepted up to there, and rejected from there on."""

    def propose(tokens, k):
        for prompt, want in zip(prompts, outputs):
            if tokens[: len(prompt)] == prompt:
                done = len(tokens) - len(prompt)
                draft = list(want[done : done + k])
                if wrong_at is not None and len(draft) > wrong_at:
                    draft[wrong_at] = (draft[wrong_at] + 1) % vocab
                return draft
        raise AssertionError("a request the oracle does not know")

    monkeypatch.setattr("pd.engine.drafter.propose", propose)


def _assert_no_leak(engine: Engine) -> None:
    assert not engine.has_unfinished
    engine.check_integrity()
    cached = engine.cache.num_cached_tokens
    assert engine.allocator.num_free_slots + cached == engine.allocator.num_slots


def test_truncate_frees_whole_pages_past_the_new_length():
    alloc = SlotAllocator(16, page_size=4)
    slots = alloc.allocate(10)  # pages 0, 1, 2 (2 slots of page 2)
    alloc.truncate(slots, 5)
    assert slots == [0, 1, 2, 3, 4] and alloc.num_free_pages == 2
    alloc.truncate(slots, 9)  # longer: nothing changes
    assert len(slots) == 5
    alloc.truncate(slots, 4)
    assert slots == [0, 1, 2, 3] and alloc.num_free_pages == 3
    alloc.extend(slots, 6)  # the tail page is taken again
    alloc.check_integrity([slots])


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("wrong_at", [0, 2, None])
def test_speculation_keeps_greedy_output_and_returns_rejected_slots(
    tiny_llama_dir, monkeypatch, page_size, wrong_at
):
    plain = _engine(tiny_llama_dir, page_size=page_size)
    spec = _engine(tiny_llama_dir, page_size=page_size, speculative_tokens=4)
    vocab = plain.runner.model_config.vocab_size
    prompts = [_prompt(seed, vocab) for seed in range(3)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = [r.token_ids for r in plain.generate(prompts, params)]
    _oracle(monkeypatch, prompts, want, vocab, wrong_at)
    assert [r.token_ids for r in spec.generate(prompts, params)] == want
    stats = spec.scheduler.stats()
    assert stats.num_spec_steps > 0
    exported = spec.stats()  # what /metrics shows
    assert (exported.num_spec_steps, exported.num_draft_tokens) == stats[-3:-1]
    assert exported.num_accepted_draft_tokens == stats.num_accepted_tokens
    if wrong_at is None:  # everything accepted: a step gives 1 + 4 tokens
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert stats.num_spec_steps < 3 * 40 / 4
    else:  # nothing, or 2 of each draft of 3 or more accepted
        assert stats.num_accepted_tokens < stats.num_draft_tokens
        assert (stats.num_accepted_tokens > 0) == (wrong_at > 0)
    _assert_no_leak(spec)


def test_drafts_stop_at_max_tokens_and_at_a_stop_token(tiny_llama_dir, monkeypatch):
    plain = _engine(tiny_llama_dir)
    spec = _engine(tiny_llama_dir, speculative_tokens=8)
    vocab = spec.runner.model_config.vocab_size
    prompt = _prompt(7, vocab)
    (full,) = plain.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0))
    _oracle(monkeypatch, [prompt], [full.token_ids], vocab, None)
    for max_tokens in (1, 2, 3, 17):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        (res,) = spec.generate([prompt], params)
        assert res.token_ids == full.token_ids[:max_tokens] and res.finish_reason == "length"
    # a stop token inside an accepted draft ends the request there
    stop = full.token_ids[13]
    first = full.token_ids.index(stop)
    params = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop])
    (res,) = spec.generate([prompt], params)
    assert res.token_ids == full.token_ids[: first + 1] and res.finish_reason == "stop"
    _assert_no_leak(spec)


def test_seeded_sampling_gives_the_same_tokens_with_or_without_speculation(
    tiny_llama_dir, monkeypatch
):
    plain = _engine(tiny_llama_dir)
    spec = _engine(tiny_llama_dir, speculative_tokens=4)
    vocab = spec.runner.model_config.vocab_size
    prompts = [_prompt(seed, vocab) for seed in range(4)]
    params = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, seed=11, ignore_eos=True)
    want = [r.token_ids for r in plain.generate(prompts, params)]
    # drafts right up to position 3, then wrong: accepted, then rejected by a different draw
    _oracle(monkeypatch, prompts, want, vocab, 3)
    assert [r.token_ids for r in spec.generate(prompts, params)] == want
    # again, now that the answers are in the cache (drafts from there, other drafts)
    assert [r.token_ids for r in spec.generate(prompts, params)] == want
    stats = spec.scheduler.stats()
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    _assert_no_leak(spec)


def test_no_speculation_in_batches_above_the_bound(tiny_llama_dir, monkeypatch):
    spec = _engine(tiny_llama_dir, speculative_tokens=4, speculative_max_batch=2)
    vocab = spec.runner.model_config.vocab_size
    prompts = [_prompt(seed, vocab) for seed in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    _oracle(monkeypatch, prompts, [r.token_ids for r in spec.generate(prompts, params)], vocab, 1)
    for p in prompts:
        spec.add_request(p, params)
    while any(r.is_prefilling for r in spec.scheduler.running) or spec.scheduler.waiting:
        spec.step()
    steps = spec.scheduler.stats().num_spec_steps
    spec.step()  # three decoding: above the bound of 2
    assert spec.scheduler.stats().num_spec_steps == steps
    while spec.has_unfinished:
        spec.step()
    _assert_no_leak(spec)


@pytest.mark.slow
def test_the_compiled_step_verifies_drafts_like_the_eager_one(tiny_llama_dir, monkeypatch):
    plain = _engine(tiny_llama_dir)
    # one bucket of 8: every verify (and plain decode step) runs padded in its graph
    spec = _engine(tiny_llama_dir, speculative_tokens=3, compile_buckets="8")
    vocab = spec.runner.model_config.vocab_size
    prompts = [_prompt(seed, vocab) for seed in range(2)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [r.token_ids for r in plain.generate(prompts, params)]
    _oracle(monkeypatch, prompts, want, vocab, 2)
    assert [r.token_ids for r in spec.generate(prompts, params)] == want
    assert spec.runner.graphs.num_runs.get(8, 0) >= 24 // 4  # 2 x (1 + 3) rows at most
    _assert_no_leak(spec)


def test_a_conversation_answered_before_is_drafted_from_the_prefix_cache(tiny_llama_dir):
    spec = _engine(tiny_llama_dir, speculative_tokens=4)
    prompt = _prompt(3, spec.runner.model_config.vocab_size)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    (first,) = spec.generate([prompt], params)
    before = spec.scheduler.stats()
    (again,) = spec.generate([prompt], params)  # its answer is in the cache now
    after = spec.scheduler.stats()
    assert again.token_ids == first.token_ids
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    assert accepted == drafted >= 24 - 1 - (after.num_spec_steps - before.num_spec_steps)
    assert after.num_spec_steps - before.num_spec_steps <= 24 // 5 + 1
    # another namespace does not see it
    spec.add_request(prompt, params, namespace="tenant-b")
    while spec.has_unfinished:
        spec.step()
    assert spec.scheduler.stats().num_accepted_tokens == after.num_accepted_tokens
    _assert_no_leak(spec)


@pytest.mark.slow
def test_smollm2_speculation_gives_identical_greedy_output_on_16_prompts(smollm2_dir):
    from pd.model.tokenizer import encode_chat

    plain = _engine(smollm2_dir, max_total_tokens=16384)
    spec = _engine(
        smollm2_dir, max_total_tokens=16384, speculative_tokens=4, speculative_max_batch=16
    )
    text = open("/usr/share/common-licenses/GPL-3").read().split("\n\n")
    asks = ["Repeat the following text exactly.", "Summarise the following text."]
    prompts = [
        encode_chat(
            plain.tokenizer, [{"role": "user", "content": f"{asks[i % 2]}\n\n{text[4 + i]}"}]
        )
        for i in range(16)
    ]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    want = [r.token_ids for r in plain.generate(prompts, params)]
    assert [r.token_ids for r in spec.generate(prompts, params)] == want
    stats = spec.scheduler.stats()
    assert stats.num_accepted_tokens > 0.3 * stats.num_draft_tokens > 0
    _assert_no_leak(spec)
