"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) in plain torch.

Parameter names follow HF transformers, so an HF state dict loads as is. The forward pass
takes a ``ForwardBatch`` (flat tokens of many requests) and reads/writes KV through the pool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pd.engine.attention import BaseAttentionBackend
from pd.engine.batch import ForwardBatch
from pd.engine.kv_pool import KVPool
from pd.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Rotary(nn.Module):
    """cos/sin tables for every position, gathered per token (neox / rotate-half layout)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(pos, cfg.rope_inv_freq())  # [max_pos, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # -> cos, sin: [T, 1, head_dim], broadcast over heads
        return self.cos[positions, None].to(dtype), self.sin[positions, None].to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        pool: KVPool,
        attn: BaseAttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attn.forward(q, k, v, self.layer, batch, pool)  # [T, H, D]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        pool: KVPool,
        attn: BaseAttentionBackend,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, batch, pool, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaBody(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaBody(cfg)
        self.rotary = Rotary(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, pool: KVPool, attn: BaseAttentionBackend
    ) -> torch.Tensor:
        """Logits ``[R, vocab]`` for each request's last token (``[T, vocab]`` if the batch
        asks for all logits)."""
        body = self.model
        h = body.embed_tokens(batch.input_ids)  # [T, hidden]
        cos, sin = self.rotary(batch.positions, h.dtype)
        attn.init_forward_metadata(batch)
        for i, layer in enumerate(body.layers):
            h = layer(h, cos, sin, batch, pool, attn)
            if batch.on_layer_done is not None:
                batch.on_layer_done(i)
        if batch.logits_indices is not None:
            h = h[batch.logits_indices]
        h = body.norm(h)
        head = body.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(h, head).float()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load an HF-named state dict; a tied checkpoint's duplicate ``lm_head`` is dropped."""
        if self.config.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
        missing, unexpected = self.load_state_dict(weights, strict=False)
        unexpected = [k for k in unexpected if "rotary_emb" not in k]
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not fit {self.config.architecture}: "
                f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
            )
