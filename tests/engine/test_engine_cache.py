"""The colocated engine with its RadixCache: same greedy tokens as with the cache off, real hits,
full-prompt hits, eviction under memory pressure, and warmup.

Expected hits are computed exactly: a request matches the longest page-aligned common prefix of
``prompt[:-1]`` with what earlier requests left in the cache (each leaves ``prompt + output[:-1]``,
the tokens whose KV it computed), as long as nothing was evicted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import pytest
import torch

from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from pd.model.tokenizer import encode_chat
from tests.hf_reference import hf_greedy

SYSTEM = (
    "You are Ada, the reference librarian of a small public library. You answer questions "
    "from visitors briefly and accurately, in plain English, with one or two sentences. If you "
    "do not know an answer, you say so and suggest where in the library the visitor could look. "
    "You never invent book titles, authors or dates, and you are always polite and patient."
)
QUESTIONS = (
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What do bees make?",
)


class Done(NamedTuple):
    token_ids: list[int]
    num_cached_tokens: int


def _make_engine(model_dir, *, cache: bool, **kw) -> Engine:
    kw.setdefault("max_total_tokens", 4096)
    kw.setdefault("host_cache_tokens", 0)  # the device pool alone (the tier: test_host_tier.py)
    return Engine(EngineConfig(model=str(model_dir), enable_prefix_cache=cache, **kw))


def _prompt(n: int, seed: int, vocab: int = 49152) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n,), generator=g).tolist()


def _empty_cache(engine: Engine) -> None:
    """Evict everything (the engine is idle, so every cached token is evictable)."""
    assert not engine.has_unfinished
    engine.cache.evict(engine.cache.num_evictable_tokens)
    assert engine.cache.num_cached_tokens == 0
    _assert_no_leak(engine)


def _assert_no_leak(engine: Engine) -> None:
    assert not engine.has_unfinished
    engine.check_integrity()
    alloc, cache = engine.allocator, engine.cache
    assert alloc.num_free_slots + cache.num_cached_tokens == alloc.num_slots
    assert cache.num_evictable_tokens == cache.num_cached_tokens, "a lock outlived its request"


def _run(engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Done]:
    """Generate as one batch, stepping by hand and checking integrity after every step."""
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    cached: dict[str, int] = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            cached[out.request_id] = out.num_cached_tokens
        engine.check_integrity()
    return [Done(tokens[i], cached[i]) for i in ids]


def _run_one_by_one(engine: Engine, prompts, params: SamplingParams) -> list[Done]:
    return [_run(engine, [p], params)[0] for p in prompts]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _expected_hit(prompt: Sequence[int], cached: Sequence[Sequence[int]], page_size: int) -> int:
    best = max((_common_prefix(prompt[:-1], c) for c in cached), default=0)
    return best - best % page_size


def _chat(engine: Engine, messages: list[dict[str, str]]) -> list[int]:
    return encode_chat(engine.tokenizer, messages)


@pytest.fixture(scope="module", params=[1, 16], ids=["page1", "page16"])
def smol_pair(request, smollm2_dir) -> tuple[Engine, Engine]:
    """(cache on, cache off) SmolLM2 engines with the given page size."""
    return (
        _make_engine(smollm2_dir, cache=True, page_size=request.param),
        _make_engine(smollm2_dir, cache=False, page_size=request.param),
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_shared_system_prompt_on_equals_off(smol_pair):
    on, off = smol_pair
    ps = on.cfg.page_size
    _empty_cache(on)
    prompts = [
        _chat(on, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        for q in QUESTIONS
    ]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    want_batch = _run(off, prompts, params)
    want_seq = _run_one_by_one(off, prompts, params)
    assert all(d.num_cached_tokens == 0 for d in want_batch + want_seq)

    # One after another on a cold cache: each request hits what the earlier ones left.
    before = (on.num_prompt_tokens, on.num_cached_tokens)
    seq = _run_one_by_one(on, prompts, params)
    assert [d.token_ids for d in seq] == [d.token_ids for d in want_seq]
    left: list[list[int]] = []
    for prompt, done in zip(prompts, seq):
        assert done.num_cached_tokens == _expected_hit(prompt, left, ps)
        left.append(prompt + done.token_ids[:-1])
    system_len = _common_prefix(prompts[0], prompts[1])
    assert seq[0].num_cached_tokens == 0
    assert all(d.num_cached_tokens >= system_len - ps for d in seq[1:]), (system_len, seq)
    num_prompt = on.num_prompt_tokens - before[0]
    num_cached = on.num_cached_tokens - before[1]
    assert num_prompt == sum(map(len, prompts))
    assert num_cached == sum(d.num_cached_tokens for d in seq)
    assert num_cached / num_prompt > 0.55  # 2 of 3 requests reuse the ~100-token system prompt

    # The same prompts as one batch: all fully cached now (less the last token, less a page).
    batch = _run(on, prompts, params)
    assert [d.token_ids for d in batch] == [d.token_ids for d in want_batch]
    for prompt, done in zip(prompts, batch):
        assert done.num_cached_tokens == (len(prompt) - 1) - (len(prompt) - 1) % ps
    _assert_no_leak(on)
    _assert_no_leak(off)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("smol_pair", [1], indirect=True, ids=["page1"])
def test_multi_turn_on_equals_off_and_hf(smol_pair, smollm2_dir):
    on, off = smol_pair
    ps = on.cfg.page_size
    _empty_cache(on)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    history = [{"role": "system", "content": "You are a helpful, concise assistant."}]
    left: list[list[int]] = []
    previous_len = 0
    for turn, text in enumerate(
        ("Tell me one fact about the Moon.", "And one about Mars?", "Which one is bigger?")
    ):
        history.append({"role": "user", "content": text})
        prompt = _chat(on, history)
        done = _run(on, [prompt], params)[0]
        assert done.token_ids == _run(off, [prompt], params)[0].token_ids, turn
        assert done.num_cached_tokens == _expected_hit(prompt, left, ps), turn
        # The previous turn's prompt is a prefix of this one (0 on the first turn).
        assert done.num_cached_tokens > previous_len - ps, turn
        left.append(prompt + done.token_ids[:-1])
        previous_len = len(prompt)
        answer = on.tokenizer.decode(done.token_ids, skip_special_tokens=True)
        history.append({"role": "assistant", "content": answer})
    assert done.num_cached_tokens > 0
    assert done.token_ids == hf_greedy(smollm2_dir, prompt, params.max_tokens)
    _assert_no_leak(on)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("page_size, length", [(1, 65), (16, 65), (16, 64)])
def test_fully_cached_prompt_still_samples_its_first_token(tiny_llama_dir, page_size, length):
    engine = _make_engine(tiny_llama_dir, cache=True, page_size=page_size, max_total_tokens=512)
    prompt = _prompt(length, seed=21)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = hf_greedy(tiny_llama_dir, prompt, 6, ignore_eos=True)
    assert _run(engine, [prompt], params)[0] == Done(want, 0)
    # The whole prompt (and 5 answer tokens) is cached now; its last token is recomputed.
    again = _run(engine, [prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert again == Done(want[:1], (length - 1) - (length - 1) % page_size)
    _assert_no_leak(engine)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("page_size", [1, 16])
def test_eviction_under_pressure_never_breaks_a_shared_prefix(tiny_llama_dir, page_size):
    # 3 prefixes x 4 requests; each needs 64 + 8 + 11 = 83 slots (96 with 16-slot pages) and
    # leaves 83 in the cache: 12 x 83 tokens cannot all stay in a 256-slot pool.
    on = _make_engine(tiny_llama_dir, cache=True, page_size=page_size, max_total_tokens=256)
    off = _make_engine(tiny_llama_dir, cache=False, page_size=page_size, max_total_tokens=256)
    prefixes = [_prompt(64, seed=100 + g) for g in range(3)]
    prompts = [prefixes[g] + _prompt(8, seed=200 + i) for i, g in enumerate([0, 1, 2, 0] * 3)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with pytest.raises(ValueError, match="KV slots, the pool has 256"):
        on.add_request(_prompt(250, seed=1), params)

    # Feed two requests per step so that later ones find their prefix cached and in use.
    pending = list(enumerate(prompts))
    ids: dict[str, int] = {}
    tokens: list[list[int]] = [[] for _ in prompts]
    cached = [0] * len(prompts)
    num_shared_evicting_steps = 0
    while pending or on.has_unfinished:
        for i, prompt in pending[:2]:
            ids[on.add_request(prompt, params)] = i
        del pending[:2]
        evicted = on.cache.stats.num_evicted_tokens
        for out in on.step():
            tokens[ids[out.request_id]] += out.new_token_ids
            cached[ids[out.request_id]] = out.num_cached_tokens
        on.check_integrity()
        # two running requests hold (locked) the same cached prefix
        in_use = [tuple(r.prompt_ids[:64]) for r in on.scheduler.running if r.num_cached_tokens]
        shared = len(in_use) > len(set(in_use))
        if shared and on.cache.stats.num_evicted_tokens > evicted:
            num_shared_evicting_steps += 1

    want = _run(off, prompts, params)
    assert tokens == [d.token_ids for d in want]
    assert all(len(t) == 12 for t in tokens)
    assert num_shared_evicting_steps > 0, "never evicted while a prefix was shared by two"
    assert sum(c >= 64 for c in cached) >= 4, cached
    assert on.cache.stats.num_evicted_tokens > 0
    _assert_no_leak(on)
    _assert_no_leak(off)


@pytest.mark.timeout(60)
def test_warmup_leaves_prefixes_cached_and_unpinned(tiny_llama_dir):
    engine = _make_engine(tiny_llama_dir, cache=True, page_size=16, max_total_tokens=512)
    prefixes = [_prompt(64, seed=31), _prompt(40, seed=32)]
    engine.warmup(prefixes)
    cache = engine.cache
    assert cache.num_cached_tokens == 64 + 32  # page-aligned prompts; the sampled token has no KV
    assert cache.num_evictable_tokens == cache.num_cached_tokens
    assert cache.num_protected_tokens == 0
    _assert_no_leak(engine)

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = prefixes[0] + _prompt(20, seed=33)
    done = _run(engine, [prompt], params)[0]
    assert done == Done(hf_greedy(tiny_llama_dir, prompt, 8, ignore_eos=True), 64)
    _assert_no_leak(engine)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill_over_a_cached_prefix_and_aborts(tiny_llama_dir, page_size):
    engine = _make_engine(
        tiny_llama_dir, cache=True, page_size=page_size, max_total_tokens=512, max_prefill_tokens=24
    )
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prefix = _prompt(100, seed=41)
    a, b = prefix + _prompt(30, seed=42), prefix + _prompt(50, seed=43)

    # Aborted after two 24-token chunks: the 48 computed tokens stay cached.
    rid = engine.add_request(a, params)
    for _ in range(2):
        assert engine.step() == []
        engine.check_integrity()
    assert engine.abort(rid).finish_reason == "abort"
    assert engine.cache.num_cached_tokens == 48
    _assert_no_leak(engine)

    done = _run(engine, [b], params)[0]
    assert done == Done(hf_greedy(tiny_llama_dir, b, 6, ignore_eos=True), 48)
    # b left its whole prompt: a now hits the 100-token prefix (page-aligned).
    done = _run(engine, [a], params)[0]
    assert done == Done(hf_greedy(tiny_llama_dir, a, 6, ignore_eos=True), 100 - 100 % page_size)

    # Aborted while decoding, and while waiting: nothing leaks, nothing stays locked.
    rid = engine.add_request(b, params)
    while not engine.step():
        engine.check_integrity()
    engine.abort(rid)
    engine.abort(engine.add_request(a, params))
    _assert_no_leak(engine)
