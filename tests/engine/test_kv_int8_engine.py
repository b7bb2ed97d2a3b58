"""The colocated engine with int8 KV (``--kv-cache-dtype int8``): a greedy answer is the same
alone and among 16, cold and warm (its prefix a radix hit), with speculative decoding, and for
every model family's tiny checkpoint; the pool holds about 3.8x the fp32 default's slots in the
same bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.attention import KernelAttentionBackend
from pd.executor.config import DEFAULT_KV_TOKENS, EngineConfig
from tests.families import FAMILIES

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _engine(model_dir: Path, **kw: object) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), kv_cache_dtype="int8", **kw))  # type: ignore[arg-type]


def _prompts(vocab: int, num: int = 16, shared: int = 40) -> list[list[int]]:
    """``num`` prompts of 5 to 95 tokens, half of them after a common prefix."""
    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, vocab, (shared,), generator=g).tolist()
    out = []
    for i in range(num):
        own = torch.randint(3, vocab, (5 + 6 * i,), generator=g).tolist()
        out.append(system + own if i % 2 else own)
    return out


def _exact_alone_and_among_sixteen_cold_and_warm(engine: Engine) -> None:
    prompts = _prompts(engine.runner.model_config.vocab_size)
    alone = [engine.generate([p], GREEDY)[0] for p in prompts]  # warm from the second on
    assert sum(r.num_cached_tokens for r in alone) > 0  # the shared prefix hit
    warm_16 = engine.generate(prompts, GREEDY)  # every prompt now cached: warm, batched
    assert all(r.num_cached_tokens > 0 for r in warm_16)
    assert [r.token_ids for r in warm_16] == [r.token_ids for r in alone]
    engine.cache.evict(engine.cache.num_evictable_tokens)  # cold again, together
    together = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    engine.check_integrity()


@pytest.mark.timeout(300)
def test_int8_kv_answers_alike_alone_and_among_sixteen_cold_and_warm(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, max_total_tokens=4096)
    assert engine.runner.pool.dtype == torch.int8
    _exact_alone_and_among_sixteen_cold_and_warm(engine)
    # speculative decoding: the drafts checked in one forward (the verify rows) change nothing
    spec = _engine(tiny_llama_dir, max_total_tokens=4096, speculative_tokens=4)
    prompts = _prompts(spec.runner.model_config.vocab_size)
    want = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    assert [r.token_ids for r in spec.generate(prompts, GREEDY)] == want
    assert [spec.generate([p], GREEDY)[0].token_ids for p in prompts] == want


@pytest.mark.timeout(120)
def test_without_determinism_int8_kv_is_still_read_by_the_kernel_alone(tiny_llama_dir):
    """``--no-deterministic`` runs library matmuls, but every attention row stays on the
    kernel (SDPA cannot read the codes), and the engine answers."""
    engine = _engine(tiny_llama_dir, max_total_tokens=1024, deterministic=False)
    assert isinstance(engine.runner.attn, KernelAttentionBackend)
    results = engine.generate(_prompts(engine.runner.model_config.vocab_size, num=3), GREEDY)
    assert all(len(r.token_ids) == GREEDY.max_tokens for r in results)
    engine.check_integrity()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_default_model_with_int8_kv_answers_alike_at_pd_serves_defaults(smollm2_dir):
    """int4 weights and compiled decode steps for 1, 2 and 4 rows, as ``pd serve`` runs, with
    the pool's default size: 32768 fp32 tokens' bytes, in int8 slots."""
    engine = _engine(smollm2_dir, quantization="int4", compile_buckets="auto")
    assert engine.allocator.num_slots == DEFAULT_KV_TOKENS * 64 * 4 // (64 + 4)
    _exact_alone_and_among_sixteen_cold_and_warm(engine)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_familys_tiny_checkpoint_runs_on_int8_kv(family_dir, family):
    engine = _engine(family_dir(family), max_total_tokens=2048)
    prompts = _prompts(engine.runner.model_config.vocab_size, num=4)
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == alone
    engine.check_integrity()
