"""Tiny random checkpoints of every model family pd serves, built with transformers' own config
classes (``from_config``, a fixed seed, three layers, a window of 8 where the family slides) and
SmolLM2's tokenizer files: ``family_dir(family)`` (a session fixture, tests/conftest.py)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

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


def make_family_dir(
    tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path, globs: tuple[str, ...]
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
            for pattern in globs:
                for path in smollm2_dir.glob(pattern):
                    shutil.copy(path, out / path.name)
            made[family] = out
        return made[family]

    return make
