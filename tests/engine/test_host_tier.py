"""The colocated engine over a host tier (real KV): prefixes the device pool evicted come back
from the host pool, and the greedy answers they give equal those computed cold (the tiny model)
and HF transformers' (SmolLM2, fp32); nothing leaks over many cycles of evict and load back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from pd.model.tokenizer import encode_chat
from tests.hf_reference import hf_greedy

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _engine(model_dir: Path, host: int, **kw: object) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), host_cache_tokens=host, **kw))


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _one(engine: Engine, prompt: list[int]) -> tuple[list[int], int]:
    """Generate one prompt; (tokens, prompt tokens served from the cache)."""
    rid = engine.add_request(prompt, GREEDY)
    tokens, cached = [], 0
    while engine.has_unfinished:
        for out in engine.step():
            assert out.request_id == rid
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
        engine.check_integrity()
    return tokens, cached


def _assert_no_leak(engine: Engine) -> None:
    engine.check_integrity()
    cache, alloc = engine.cache, engine.allocator
    assert cache.num_evictable_tokens == cache.num_cached_tokens, "a lock outlived its request"
    assert alloc.num_free_slots + cache.num_cached_tokens == alloc.num_slots


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("page_size", "kv"), [(1, "auto"), (16, "auto"), (16, "int8")])
def test_prefixes_loaded_back_from_the_host_give_the_cold_answers(
    tiny_llama_dir: Path, page_size: int, kv: str
) -> None:
    """(int8 KV: the tier holds the codes and scales, and the cold engine's KV is int8 too.)"""
    kw = {"max_total_tokens": 384, "kv_cache_dtype": kv}
    tiered = _engine(tiny_llama_dir, 2048, page_size=page_size, **kw)
    cold = _engine(tiny_llama_dir, 0, enable_prefix_cache=False, **kw)
    vocab = tiered.runner.model_config.vocab_size
    systems = [_prompt(150, seed, vocab) for seed in range(4)]  # 4 x 150 > the 384-slot pool
    for s in systems:
        _one(tiered, s + [1])
    tier = tiered.cache.tier_stats
    assert tier is not None and tier.num_cached_tokens >= 2 * 150 - page_size
    for i, s in enumerate(systems):
        prompt = s + _prompt(5, 100 + i, vocab)
        tokens, cached = _one(tiered, prompt)
        assert tokens == _one(cold, prompt)[0], i
        assert cached >= 150 - page_size, (i, cached)  # from the device or loaded back
    tier = tiered.cache.tier_stats
    assert tier.num_hit_tokens >= 150 and tier.num_loads >= 1
    _assert_no_leak(tiered)


@pytest.mark.timeout(120)
def test_no_slot_or_host_page_leaks_over_fifty_cycles(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, 512, max_total_tokens=256, page_size=4)
    vocab = engine.runner.model_config.vocab_size
    prompts = [_prompt(60 + 17 * i, i, vocab) for i in range(6)]
    for cycle in range(50):
        _one(engine, prompts[cycle % 6] + [3 + cycle])
    tier = engine.cache.tier_stats
    assert tier.num_loads > 0 and tier.num_dropped_tokens > 0
    _assert_no_leak(engine)
    engine.cache.evict(engine.cache.num_evictable_tokens)
    assert engine.allocator.num_free_slots == 256


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_prefixes_from_disk_and_after_a_restart_give_the_cold_answers(
    tiny_llama_dir: Path, tmp_path: Path, kv: str
) -> None:
    """The host tier too small to keep them: prefixes come back from the disk tier; a new
    engine on the same directory (a replacement node) finds them and hits at once, and one
    whose KV has the other dtype finds none (its chunks are keyed by the KV's format)."""
    kw = {"max_total_tokens": 256, "page_size": 16, "disk_cache_dir": str(tmp_path)}
    tiered = _engine(tiny_llama_dir, 256, kv_cache_dtype=kv, **kw)
    cold = _engine(
        tiny_llama_dir, 0, max_total_tokens=384, enable_prefix_cache=False, kv_cache_dtype=kv
    )
    vocab = tiered.runner.model_config.vocab_size
    systems = [_prompt(192, seed, vocab) for seed in range(4)]  # 768 > 256 + 256
    for s in systems:
        _one(tiered, s + [1])
    tiered.cache.lower.disk.flush()  # the writer thread's chunks are on disk
    for i, s in enumerate(systems[:2]):  # the oldest: on disk only by now
        prompt = s + _prompt(5, 200 + i, vocab)
        tokens, cached = _one(tiered, prompt)
        assert tokens == _one(cold, prompt)[0], i
        assert cached >= 192 - 16, (i, cached)
    disk = tiered.cache.tier_stats.disk
    assert disk.num_hit_tokens >= 128 and disk.num_written > 0 and disk.num_rejected == 0
    _assert_no_leak(tiered)
    _one(tiered, systems[3] + [2])  # reused: the hot prefix is written through to disk
    tiered.cache.lower.disk.flush()
    prompt = systems[3] + _prompt(5, 300, vocab)
    other = _engine(tiny_llama_dir, 1024, kv_cache_dtype="auto" if kv == "int8" else "int8", **kw)
    assert _one(other, prompt)[1] == 0  # KV of another dtype: never read
    restarted = _engine(tiny_llama_dir, 1024, kv_cache_dtype=kv, **kw)
    tokens, cached = _one(restarted, prompt)
    assert tokens == _one(cold, prompt)[0]
    assert cached >= 192 - 64, cached  # its whole 64-token chunks
    _assert_no_leak(restarted)


@pytest.mark.timeout(120)
def test_a_disk_tier_gone_read_only_mid_run_is_turned_off_and_the_engine_answers_on(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """The disk directory turns read-only while prefixes wait there (the file system remounted
    read-only after errors): the engine's step raises nothing, every answer equals the cold
    one, and the tier is off and says so in the node's stats."""
    from tests.cache.test_disk_tier import _make_read_only

    kw = {"max_total_tokens": 256, "page_size": 16, "disk_cache_dir": str(tmp_path)}
    tiered = _engine(tiny_llama_dir, 256, **kw)
    cold = _engine(tiny_llama_dir, 0, max_total_tokens=384, enable_prefix_cache=False)
    vocab = tiered.runner.model_config.vocab_size
    systems = [_prompt(192, seed, vocab) for seed in range(4)]
    for s in systems:
        _one(tiered, s + [1])
    disk = tiered.cache.lower.disk
    disk.flush()
    assert disk.stats.num_written > 0
    (model_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    undo = _make_read_only(model_dir)
    try:
        for i, s in enumerate([*systems, *systems]):  # on disk, then pushed down again
            prompt = s + _prompt(5, 400 + i, vocab)
            assert _one(tiered, prompt)[0] == _one(cold, prompt)[0], i
            disk.flush()
        stats = tiered.core.stats("prefill")
        assert stats.disk_off == 1 and disk.stats.is_off
        _assert_no_leak(tiered)
    finally:
        undo()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smollm2_from_the_host_tier_equals_hf(smollm2_dir: Path) -> None:
    engine = _engine(smollm2_dir, 4096, max_total_tokens=256)
    system = (
        "You are the help desk of a city library. Answer in one short sentence, politely, "
        "and never invent titles, authors or dates. The library opens at nine and closes at "
        "six, lends books for three weeks, and has a reading room on the second floor."
    )
    chats = [
        [{"role": "system", "content": system}, {"role": "user", "content": q}]
        for q in ("When do you open?", "How long can I keep a book?", "Where can I read?")
    ]
    prompts = [encode_chat(engine.tokenizer, c) for c in chats]
    other = [encode_chat(engine.tokenizer, [{"role": "user", "content": "Hi " * 200}])]
    _one(engine, prompts[0])
    _one(engine, other[0])  # pushes the system prompt down to the host
    loads = engine.cache.tier_stats.num_loads
    for p in prompts[1:]:
        tokens, cached = _one(engine, p)
        assert tokens == hf_greedy(smollm2_dir, p, GREEDY.max_tokens)
        assert cached > 40
    assert engine.cache.tier_stats.num_loads > loads
    _assert_no_leak(engine)
