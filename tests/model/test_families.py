"""Every model family pd serves against HF transformers on a tiny random checkpoint built here
with transformers' own config classes (``from_config``, a fixed seed, three layers, a window of
8 where the family slides): greedy tokens equal HF's on prompts longer than the window (a
difference allowed only where HF's top two logits tie within 1e-3), logits close, and a
sliding-window model's prefix hits, chunks and batches give a cold prompt's bits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from pd.model.families import SUPPORTED_ARCHITECTURES
from tests.executor.test_deterministic import SCHEDULES, _Probe
from tests.families import FAMILIES, VOCAB, WINDOW


def _hf(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_greedy(hf: Any, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """HF's greedy tokens and the logits each was chosen from."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=[],
                          output_logits=True, return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    return out.sequences[0, len(prompt) :].tolist(), [lg[0] for lg in out.logits]


def _assert_same_or_tied(ours: list[int], theirs: list[int], logits: list[torch.Tensor]) -> None:
    """Equal tokens, or the first difference where HF's top two logits tie within 1e-3."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            top2 = logits[i].topk(2).values
            assert float(top2[0] - top2[1]) < 1e-3, (i, ours, theirs, top2)
            return
    assert len(ours) == len(theirs)


def test_every_family_is_supported_and_others_are_refused_naming_the_list() -> None:
    from pd.model.config import ModelConfig

    assert len(SUPPORTED_ARCHITECTURES) == len(FAMILIES)
    with pytest.raises(
        ValueError, match="unsupported architecture 'FalconForCausalLM'; pd serves: Llama"
    ):
        ModelConfig.from_hf({"architectures": ["FalconForCausalLM"], "num_attention_heads": 4})


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logits_equal_hf(family: str, family_dir) -> None:
    model_dir = family_dir(family)
    hf = _hf(model_dir)
    engine = Engine(EngineConfig(model=str(model_dir), quantization="none", max_total_tokens=2048))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for seed, n in enumerate((5, 3 * WINDOW, 41)):
        prompt = _prompt(n, seed)
        theirs, logits = _hf_greedy(hf, prompt, 12)
        ours = engine.generate([prompt], params)[0].token_ids
        _assert_same_or_tied(ours, theirs, logits)
    prompt = _prompt(37, 7)
    with torch.inference_mode():
        want = hf(torch.tensor([prompt])).logits[0]
    runner = engine.runner
    from pd.core.batch import SeqInput

    got = runner.forward([SeqInput(prompt, list(range(1000, 1037)), 0)], return_all_logits=True)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "phi3", "qwen3_moe"])
@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_a_family_computes_a_prompt_to_the_same_bits_every_way(family, quantization, family_dir):
    """Sliding windows (Gemma, Phi-3) and experts (Qwen3-MoE): one chunk, chunks, a batch,
    decode rows, all the same bits (the deterministic path)."""
    cfg = EngineConfig(
        model=str(family_dir(family)), quantization=quantization, max_total_tokens=16384
    )
    from pd.executor.runner import ModelRunner

    probe = _Probe(ModelRunner(cfg), 3 * WINDOW + 40)
    ref_kv, ref_logits = probe.one_chunk()
    for name, schedule in SCHEDULES.items():
        kv, logits = schedule(probe)
        assert torch.equal(kv, ref_kv) and torch.equal(logits, ref_logits), name


def test_a_warm_answer_equals_the_cold_one_past_the_window(family_dir) -> None:
    """A 200-token shared system prompt, a window of 8: the second request hits the cached
    prefix and answers as the first did, and as HF does."""
    model_dir = family_dir("gemma2")
    engine = Engine(EngineConfig(model=str(model_dir), max_total_tokens=4096))
    system = _prompt(200, 11)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    first = engine.generate([system + [5, 6, 7]], params)[0]
    again = engine.generate([system + [5, 6, 7]], params)[0]
    assert again.num_cached_tokens >= 200 and first.token_ids == again.token_ids
    theirs, logits = _hf_greedy(_hf(model_dir), system + [5, 6, 7], 10)
    _assert_same_or_tied(first.token_ids, theirs, logits)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "qwen3_moe"])
def test_compiled_steps_and_speculation_give_the_same_tokens(family: str, family_dir) -> None:
    """Gemma 2's capped scores and windows in a compiled step, Qwen3-MoE's experts run
    eagerly between its graphs: the tokens of eager steps, with speculation on too."""
    model_dir = str(family_dir(family))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    base = {"model": model_dir, "max_total_tokens": 4096, "quantization": "int4"}
    # a prompt that repeats itself, so drafts are proposed and some accepted
    prompts = [_prompt(20, 3) * 3, _prompt(41, 4), _prompt(9, 5)]
    want = [r.token_ids for r in Engine(EngineConfig(**base)).generate(prompts, params)]
    compiled = Engine(EngineConfig(**base, compile_buckets="1,2"))
    assert set(compiled.runner.graphs.compile_seconds) == {1, 2}
    assert [r.token_ids for r in compiled.generate(prompts, params)] == want
    assert [r.token_ids for r in compiled.generate(prompts[:1], params)] == want[:1]
    assert sum(compiled.runner.graphs.num_runs.values()) > 0
    spec = Engine(EngineConfig(**base, speculative_tokens=4))
    assert [r.token_ids for r in spec.generate(prompts, params)] == want
    assert spec.stats().num_spec_steps > 0
