"""Model hyper-parameters read from an HF ``config.json``: the shared decoder's shape, and the
knobs by which a family differs from Llama (``pd.model.families`` reads each family's)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from pd.core.attention import AttentionSpec
from pd.model.families import config_fields


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: dict[str, Any] | None = field(default=None, compare=False)
    # -- how a family differs from Llama (pd.model.families) --------------------------------
    qk_norm: bool = False  # an RMSNorm over each query and key head before rotary (Qwen3)
    norm_offset: float = 0.0  # norms scale by (offset + weight): Gemma's are 1 + weight
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden_size))
    activation: str = "silu"  # of the gated MLP: silu | gelu_tanh (Gemma's GeGLU)
    sandwich_norms: bool = False  # a norm after attention and around the MLP too (Gemma)
    query_scale: float | None = None  # attention scores' scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> tanh(scores / cap) * cap (Gemma 2)
    final_softcap: float | None = None  # the same on the logits
    # per layer: the last this many positions attended to (0: all; sliding-window layers)
    layer_windows: tuple[int, ...] = ()
    # per layer, where a family's local and global layers rotate differently (Gemma 3): the
    # rope theta of sliding-window layers (None: rope_theta)
    local_rope_theta: float | None = None
    rotary_dim: int = 0  # dims of a head that rotate (0: all; Phi-3's partial rotary)
    # mixture of experts: each of these layers routes a token to num_experts_per_tok of
    # num_experts gated MLPs of moe_intermediate_size (empty: every layer a dense MLP)
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the top-k routing weights renormalized to sum to 1

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(
                f"{len(self.layer_windows)} layer windows for {self.num_layers} layers"
            )
        if self.moe_layers and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"{self.num_experts_per_tok} experts a token of {self.num_experts}")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """The config of an HF ``config.json``; ValueError naming what pd does not serve (an
        architecture, with the list it does; a rope scaling; a family's unsupported option)."""
        return cls(**config_fields(cfg))

    @property
    def window_of(self) -> tuple[int, ...]:
        """Each layer's window (0: every position), whatever the family."""
        return self.layer_windows or (0,) * self.num_layers

    def attention_specs(self) -> list[AttentionSpec]:
        """Each layer's scale, score cap and window (what an attention backend is built with)."""
        scale = self.head_dim**-0.5 if self.query_scale is None else self.query_scale
        return [AttentionSpec(scale, self.attn_softcap or 0.0, w) for w in self.window_of]

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    def rope_inv_freq(self, theta: float | None = None) -> torch.Tensor:
        """Inverse RoPE frequencies, ``[rotary_dim // 2]`` float32, with any scaling applied;
        ``theta``: another base than ``rope_theta`` (a family's local layers)."""
        dim = self.rotary_dim or self.head_dim
        base = self.rope_theta if theta is None else theta
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = self.rope_scaling
        if scaling is None or theta is not None:  # a local theta rotates unscaled (Gemma 3)
            return inv_freq
        kind = scaling["rope_type"]
        if kind == "linear":
            return inv_freq / float(scaling["factor"])
        if kind == "llama3":
            return _llama3_inv_freq(inv_freq, scaling, self.max_position_embeddings)
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: linear, llama3")


def _llama3_inv_freq(
    inv_freq: torch.Tensor, scaling: dict[str, Any], max_position_embeddings: int
) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", max_position_embeddings))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)
