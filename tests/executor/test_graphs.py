"""Compiled decode steps (``pd.executor.graphs``): the same greedy tokens as eager steps, in
every bucket and padded into a larger one; eager where no bucket covers a batch."""

from __future__ import annotations

import pytest
import torch

from pd.core.batch import DecodeBatch, SeqInput
from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from pd.executor.graphs import parse_buckets

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _engine(model_dir, buckets: str) -> Engine:
    return Engine(
        EngineConfig(model=str(model_dir), max_total_tokens=4096, compile_buckets=buckets)
    )


def _prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(100, vocab, (5 + 9 * i,), generator=g).tolist() for i in range(n)]


def _assert_no_leak(engine: Engine) -> None:
    engine.check_integrity()
    cached = engine.cache.num_cached_tokens
    assert engine.allocator.num_free_slots + cached == engine.allocator.num_slots


def test_parse_buckets_reads_sizes_and_off_and_refuses_the_rest():
    assert parse_buckets("8,1, 4") == (1, 4, 8)
    assert parse_buckets("off") == parse_buckets("") == ()
    for bad in ("0,2", "a,b", ","):
        with pytest.raises(ValueError, match="compile buckets"):
            parse_buckets(bad)
    with pytest.raises(ValueError, match="compile buckets"):
        EngineConfig(compile_buckets="1,x")


def test_a_decode_batch_pads_rows_onto_the_scratch_slot():
    seqs = [SeqInput([7], [3, 4, 5], 2), SeqInput([9], [6, 8], 1)]
    b = DecodeBatch.build(seqs, 4, scratch_slot=99)
    assert b.input_ids.tolist() == [7, 9, 0, 0]
    assert b.positions.tolist() == [2, 1, 0, 0]
    assert b.out_slots.tolist() == [5, 8, 99, 99]
    assert b.kv_idx.tolist() == [[3, 4, 5], [6, 8, 99], [99, 99, 99], [99, 99, 99]]
    assert b.kv_mask.tolist() == [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 0, 0]]
    with pytest.raises(ValueError, match="5 decode rows for a batch of 4"):
        DecodeBatch.build(seqs * 2 + seqs[:1], 4, scratch_slot=99)


@pytest.mark.slow
def test_tiny_compiled_steps_match_eager_in_their_bucket_padded_and_beyond(tiny_llama_dir):
    compiled, eager = _engine(tiny_llama_dir, "1,4"), _engine(tiny_llama_dir, "off")
    graphs = compiled.runner.graphs
    assert set(graphs.compile_seconds) == {1, 4}
    assert eager.runner.graphs.compile_seconds == {}
    vocab = compiled.runner.model_config.vocab_size
    for n, bucket in ((1, 1), (3, 4), (4, 4)):
        runs = graphs.num_runs.get(bucket, 0)
        prompts = _prompts(n, vocab)
        got = [r.token_ids for r in compiled.generate(prompts, GREEDY)]
        assert got == [r.token_ids for r in eager.generate(prompts, GREEDY)], n
        # every decode step but those beside a prefill chunk ran in the bucket's graph
        assert graphs.num_runs[bucket] - runs >= GREEDY.max_tokens - 2 * n
    # 6 rows: above every bucket, eager
    before = dict(graphs.num_runs)
    prompts = _prompts(6, vocab)
    got = [r.token_ids for r in compiled.generate(prompts, GREEDY)]
    assert got == [r.token_ids for r in eager.generate(prompts, GREEDY)]
    assert graphs.num_runs.get(4, 0) - before.get(4, 0) < GREEDY.max_tokens // 2
    _assert_no_leak(compiled)


@pytest.mark.slow
@pytest.mark.compile
def test_smollm2_compiled_steps_give_eager_greedy_tokens_in_buckets_1_and_3(smollm2_dir):
    from pd.model.tokenizer import encode_chat

    # bucket 3 pads a batch of 2; larger buckets: the tiny model's test above
    compiled, eager = _engine(smollm2_dir, "1,3"), _engine(smollm2_dir, "off")
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Name three primary colors.",
        "What is 17 times 23?",
        "Explain gravity to a child.",
        "Give me a synonym for happy.",
        "Who wrote Hamlet?",
        "How many legs does a spider have?",
    ]
    prompts = [encode_chat(compiled.tokenizer, [{"role": "user", "content": q}]) for q in questions]
    graphs = compiled.runner.graphs
    for n, bucket in ((1, 1), (2, 3), (3, 3)):
        runs = graphs.num_runs.get(bucket, 0)
        got = [r.token_ids for r in compiled.generate(prompts[:n], GREEDY)]
        assert got == [r.token_ids for r in eager.generate(prompts[:n], GREEDY)], n
        assert graphs.num_runs[bucket] - runs >= GREEDY.max_tokens - 2 * n
    _assert_no_leak(compiled)


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int4", "fp16"])
def test_quantized_formats_compile_or_stay_eager_with_the_same_tokens(tiny_llama_dir, quantization):
    # deterministic (the default): every layer and the fp16 head are pd's opaque matmuls, all
    # in the graph; the tokens must be eager's
    def make(buckets: str) -> Engine:
        cfg = EngineConfig(
            model=str(tiny_llama_dir), quantization=quantization, compile_buckets=buckets
        )
        return Engine(cfg)

    compiled, eager = make("2"), make("off")
    assert compiled.runner.graphs.head_in_graph is True
    assert set(compiled.runner.graphs.compile_seconds) == {2}
    prompts = _prompts(2, compiled.runner.model_config.vocab_size)
    got = [r.token_ids for r in compiled.generate(prompts, GREEDY)]
    assert got == [r.token_ids for r in eager.generate(prompts, GREEDY)]
    _assert_no_leak(compiled)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_deterministic_compiled_steps_give_eagers_bits_in_bf16_too(tiny_llama_dir, dtype):
    """With every linear, norm and attention on pd's opaque kernels, a compiled bf16 step has
    nothing left to fuse its own way: its tokens and logits are eager's, bit for bit."""

    def make(buckets: str) -> Engine:
        return Engine(EngineConfig(model=str(tiny_llama_dir), dtype=dtype, compile_buckets=buckets))

    compiled, eager = make("4"), make("off")
    assert set(compiled.runner.graphs.compile_seconds) == {4}
    prompts = _prompts(3, compiled.runner.model_config.vocab_size)
    got = [r.token_ids for r in compiled.generate(prompts, GREEDY)]
    assert got == [r.token_ids for r in eager.generate(prompts, GREEDY)]
    assert compiled.runner.graphs.num_runs.get(4, 0) >= GREEDY.max_tokens - 2
    _assert_no_leak(compiled)
