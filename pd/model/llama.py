"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) in plain torch.

Parameter names follow HF transformers, so an HF state dict loads as is. The forward pass
takes a ``ForwardBatch`` (flat tokens of many requests) and reads/writes KV through the pool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pd.core.attention import BaseAttentionBackend
from pd.core.batch import ForwardBatch
from pd.core.kv_pool import KVPool
from pd.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fixed = False  # through pd.model.fixed_ops (``LlamaForCausalLM.use_fixed_ops``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one call: bit-equal to HF's fp32 norm; within a rounding of it in bf16 (which HF
        # rounds before the weight multiply, torch after)
        if self.fixed:
            return torch.ops.pd.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Rotary(nn.Module):
    """cos/sin tables for every position, gathered per token (neox / rotate-half layout)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(pos, cfg.rope_inv_freq())  # [max_pos, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi]: the sign lives in the table
        signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", signed_sin, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # -> cos, signed sin: [T, 1, head_dim], broadcast over heads
        cos, sin = self.cos.index_select(0, positions), self.sin.index_select(0, positions)
        return cos[:, None].to(dtype), sin[:, None].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """neox rotation ``x * cos + rotate_half(x) * sin``, given ``Rotary``'s signed sin."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        # q, k and v in one matmul: rows [q heads | k heads | v heads]
        num_qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, num_qkv, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.fixed = False  # rotary through pd.model.fixed_ops

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        pool: KVPool,
        attn: BaseAttentionBackend,
    ) -> torch.Tensor:
        t, num_qk = x.shape[0], self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(x).view(t, num_qk + self.num_kv_heads, self.head_dim)
        rotate = torch.ops.pd.rotary if self.fixed else apply_rotary
        qk = rotate(qkv[:, :num_qk], cos, sin)  # q and k heads rotate alike
        q, k, v = qk[:, : self.num_heads], qk[:, self.num_heads :], qkv[:, num_qk:]
        out = attn.forward(q, k, v, self.layer, batch, pool)  # [T, H, D]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # gate and up in one matmul: rows [gate | up]
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.fixed = False  # the gated SiLU through pd.model.fixed_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed:
            return self.down_proj(torch.ops.pd.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


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
        # given a weight, the embedding skips its random init, which under the loader's meta
        # device imported torch._dynamo (``load_weights`` has why); the loader overwrites it
        embed = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=embed)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaBody(cfg)
        self.rotary: Rotary  # its tables are not in the checkpoint: made by ``load_weights``
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._tie_head()

    def use_fixed_ops(self) -> None:
        """Run the norms, the rotary embedding and the gated SiLU as ``pd.model.fixed_ops``'
        opaque operators (built already: ``fixed_ops.available()``), so that a compiled step
        computes them as the eager forward does."""
        for module in self.modules():
            if isinstance(module, RMSNorm | Attention | MLP):
                module.fixed = True

    def _tie_head(self) -> None:
        # Sharing the Parameter (as HF does); re-done after loading, since moving a module off
        # the meta device gives each module its own copy.
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, pool: KVPool, attn: BaseAttentionBackend
    ) -> torch.Tensor:
        """Logits ``[R, vocab]`` for each request's last token (``[T, vocab]`` if the batch
        asks for all logits)."""
        return self.compute(batch, pool, attn)

    def compute(
        self, batch: ForwardBatch, pool: KVPool, attn: BaseAttentionBackend
    ) -> torch.Tensor:
        """``forward`` without its inference-mode switch: what ``torch.compile`` traces (the
        caller is in inference mode already; a switch inside the graph breaks freezing)."""
        return self.logits(self.hidden(batch, pool, attn))

    def hidden(self, batch: ForwardBatch, pool: KVPool, attn: BaseAttentionBackend) -> torch.Tensor:
        """The final norm's output ``[R, hidden]`` (``[T, hidden]``): what the head reads."""
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
        return body.norm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h).float()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load an HF-named state dict: q/k/v and gate/up are concatenated into the fused
        projections; a tied checkpoint's duplicate ``lm_head`` is dropped. The tensors become
        the parameters (no copy), and the rotary tables are computed here, on their device: the
        model is built on the meta device, where building the tables in ``__init__`` (or
        ``to_empty``) ran torch's Python meta kernels, whose first call imports torch._dynamo
        and sympy, seconds of a node's start."""
        tied = self.config.tie_word_embeddings
        if tied:
            weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
        fused = _fuse_projections(weights)  # assign: a model built on the meta device takes them
        missing, unexpected = self.load_state_dict(fused, strict=False, assign=True)
        self._tie_head()
        self.rotary = Rotary(self.config).to(self.model.embed_tokens.weight.device)
        missing = [k for k in missing if not (tied and k == "lm_head.weight")]
        unexpected = [k for k in unexpected if "rotary_emb" not in k]
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not fit {self.config.architecture}: "
                f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
            )


# fused parameter -> the HF parameters concatenated (along output rows) into it
_FUSED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def _fuse_projections(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names -> this model's: ``x.q_proj.weight`` + ``x.k_proj.weight`` + ``x.v_proj.weight``
    -> ``x.qkv_proj.weight`` (biases alike). A part that is missing leaves the others as they
    are, so ``load_state_dict`` reports them."""
    out = dict(weights)
    for fused, parts in _FUSED_PROJECTIONS.items():
        for name in weights:
            prefix, sep, suffix = name.rpartition(f".{parts[0]}.")
            names = [f"{prefix}.{part}.{suffix}" for part in parts]
            if sep and all(n in out for n in names):
                out[f"{prefix}.{fused}.{suffix}"] = torch.cat([out.pop(n) for n in names])
    return out
