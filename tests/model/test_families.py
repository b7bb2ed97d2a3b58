"""Every model family pd serves against HF transformers on a tiny random checkpoint built here
with transformers' own config classes (``from_config``, a fixed seed, three layers, a window of
8 where the family slides): greedy tokens equal HF's on prompts longer than the window (a
difference allowed only where HF's top two logits tie within 1e-3), logits close, and a
sliding-window model's prefix hits, chunks and batches give a cold prompt's bits."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pd.core.sampling_params import SamplingParams
from pd.engine.config import EngineConfig
from pd.engine.engine import Engine
from pd.model.families import SUPPORTED_ARCHITECTURES
from tests.conftest import _TOKENIZER_GLOBS
from tests.engine.test_deterministic import SCHEDULES, _Probe

VOCAB = 1024
WINDOW = 8
_DIMS = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2,
)  # fmt: skip
_SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]


def _configs() -> dict[str, Callable[[], Any]]:
    import transformers as tf

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    return {
        "llama": lambda: tf.LlamaConfig(tie_word_embeddings=False, **_DIMS),
        "mistral": lambda: tf.MistralConfig(sliding_window=WINDOW, **_DIMS),
        "qwen2": lambda: tf.Qwen2Config(tie_word_embeddings=False, **_DIMS),
        "qwen3": lambda: tf.Qwen3Config(tie_word_embeddings=False, **_DIMS),
        "gemma2": lambda: tf.Gemma2Config(
            sliding_window=WINDOW, query_pre_attn_scalar=24, layer_types=_SLIDING, **_DIMS
        ),
        "gemma3": lambda: tf.Gemma3TextConfig(
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            layer_types=_SLIDING,
            final_logit_softcapping=30.0,
            rope_parameters={"sliding_attention": rope, "full_attention": {**rope, "rope_theta": 1e5}},
            **_DIMS,
        ),
        "phi3": lambda: tf.Phi3Config(
            sliding_window=WINDOW, rope_parameters={**rope, "partial_rotary_factor": 0.5}, **_DIMS
        ),
        "mixtral": lambda: tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **_DIMS),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
            mlp_only_layers=[1], **_DIMS,
        ),
    }  # fmt: skip


FAMILIES = list(_configs())


def _randomize(model: torch.nn.Module) -> None:
    """Norm weights and biases drawn too (HF starts them at 1 or 0, which would hide a norm
    pd forgot)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.3, 0.5) if "gemma" in type(model).__name__.lower() else p.uniform_(
                    0.5, 1.5
                )
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.2)


@pytest.fixture(scope="session")
def family_dir(
    tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> Callable[[str], Path]:
    """``make(family) -> dir``: a tiny random checkpoint of that family with SmolLM2's
    tokenizer files, written once per session."""
    from transformers import AutoModelForCausalLM

    made: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in made:
            out = tmp_path_factory.mktemp(f"family_{family}")
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(_configs()[family](), dtype=torch.float32)
            _randomize(model)
            model.save_pretrained(str(out), safe_serialization=True)
            for pattern in _TOKENIZER_GLOBS:
                for path in smollm2_dir.glob(pattern):
                    shutil.copy(path, out / path.name)
            made[family] = out
        return made[family]

    return make


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
    from pd.engine.runner import ModelRunner

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
