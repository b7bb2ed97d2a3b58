"""The decoder every family runs (``pd.model.families`` says how each differs from Llama), in
plain torch.

Parameter names follow HF transformers' Llama (a family's other names are mapped on loading:
``families.to_decoder_weights``). The forward pass takes a ``ForwardBatch`` (flat tokens of many
requests) and reads and writes KV through the pool; attention is the backend's, which knows
each layer's scale, score cap and window (``ModelConfig.attention_specs``).

A layer: ``h += attn(norm(h))``, then ``h += mlp(norm(h))``, where Gemma's sandwich norms also
normalize each block's output before it is added; the MLP is gated (SiLU, or GeGLU), or a
mixture of such experts (``MoE``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pd.core.attention import BaseAttentionBackend
from pd.core.batch import ForwardBatch
from pd.core.kv_pool import KVPool
from pd.model.config import ModelConfig
from pd.model.families import to_decoder_weights
from pd.model.sharding import TensorParallel, shard_config, shard_weights


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dim. A family whose norms scale by ``1 + weight``
    (Gemma) has the 1 folded into the weight on loading (``DecoderLM.load_weights``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fixed = False  # through pd.model.fixed_ops (``DecoderLM.use_fixed_ops``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one call: bit-equal to HF's fp32 norm; within a rounding of it in bf16 (which HF
        # rounds before the weight multiply, torch after)
        if self.fixed:
            return torch.ops.pd.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Rotary(nn.Module):
    """cos/sin tables for every position, gathered per token (neox / rotate-half layout), over
    the first ``rotary_dim`` dims of a head."""

    def __init__(self, cfg: ModelConfig, theta: float | None = None) -> None:
        super().__init__()
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(pos, cfg.rope_inv_freq(theta))  # [max_pos, rotary_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi]: the sign lives in the table
        signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", signed_sin, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # -> cos, signed sin: [T, 1, rotary_dim], broadcast over heads
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
        self.rotary_dim = cfg.rotary_dim or cfg.head_dim
        self.uses_local_rope = cfg.local_rope_theta is not None and cfg.window_of[layer] > 0
        # q, k and v in one matmul: rows [q heads | k heads | v heads]
        num_qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, num_qkv, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.fixed = False  # rotary through pd.model.fixed_ops
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # o_proj by rows

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        pool: KVPool,
        attn: BaseAttentionBackend,
    ) -> torch.Tensor:
        t, num_qk = x.shape[0], self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(x).view(t, num_qk + self.num_kv_heads, self.head_dim)
        qk = qkv[:, :num_qk]
        if self.q_norm is not None and self.k_norm is not None:  # per head, before rotary
            qk = torch.cat(
                (self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), 1
            )
        qk = self._rotate(qk, *rope)  # q and k heads rotate alike
        q, k, v = qk[:, : self.num_heads], qk[:, self.num_heads :], qkv[:, num_qk:]
        out = attn.forward(q, k, v, self.layer, batch, pool)  # [T, H, D]
        out = self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
        return out if self.reduce is None else self.reduce(out)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotate = torch.ops.pd.rotary if self.fixed else apply_rotary
        if self.rotary_dim == self.head_dim:
            return rotate(x, cos, sin)
        d = self.rotary_dim  # partial rotary: the rest of each head passes through
        return torch.cat((rotate(x[..., :d], cos, sin), x[..., d:]), dim=-1)


class MLP(nn.Module):
    """The gated MLP: ``down(act(gate) * up)``, act SiLU or tanh-GELU (GeGLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str) -> None:
        super().__init__()
        # gate and up in one matmul: rows [gate | up]
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.activation = activation
        self.fixed = False  # the gated activation through pd.model.fixed_ops
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # down_proj by rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self._gated(self.gate_up_proj(x)))
        return out if self.reduce is None else self.reduce(out)

    def _gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fixed:
            op = torch.ops.pd.silu_mul if self.activation == "silu" else torch.ops.pd.gelu_tanh_mul
            return op(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return act * up


class MoE(nn.Module):
    """A mixture of experts: the router picks each token's ``num_experts_per_tok`` experts by
    softmax, then top-k (renormalized if ``norm_topk_prob``); each expert chosen by any token
    runs once on all its tokens (its weights read once a step, not once a token), and a
    token's outputs are added weighted, in expert order: the same order whatever the batch.

    Routing is data-dependent: a compiled step runs this block eagerly between its graphs
    (``pd.executor.graphs`` disables its forward for torch.compile: not here, where the
    decorator would import torch._dynamo into every process that builds a model)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(
            MLP(cfg.hidden_size, cfg.moe_intermediate_size, cfg.activation)
            for _ in range(cfg.num_experts)
        )
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        # tensor parallel: each expert's partial sums, weighted and added, then one all-reduce
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]; probs, weights: fp32
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in chosen.unique().tolist():  # ascending
            rows, slot = torch.where(chosen == e)
            y = self.experts[e](x[rows]).float() * weights[rows, slot, None]
            out.index_add_(0, rows, y)
        out = out.to(x.dtype)
        return out if self.reduce is None else self.reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        if cfg.is_moe(layer):
            self.mlp: nn.Module = MoE(cfg)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.activation)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # the MLP's
        # Gemma's sandwich: each block's output normalized before it joins the residual
        self.attn_out_norm = (
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None
        )
        self.mlp_out_norm = (
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None
        )

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        pool: KVPool,
        attn: BaseAttentionBackend,
    ) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(h), rope, batch, pool, attn)
        h = h + (a if self.attn_out_norm is None else self.attn_out_norm(a))
        m = self.mlp(self.post_attention_layernorm(h))
        return h + (m if self.mlp_out_norm is None else self.mlp_out_norm(m))


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # given a weight, the embedding skips its random init, which under the loader's meta
        # device imported torch._dynamo (``load_weights`` has why); the loader overwrites it
        embed = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=embed)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderLM(nn.Module):
    """The whole model, or with ``tp`` one rank's shard of it (``pd.model.sharding``):
    ``config`` is then the shard's (its heads and MLP columns), ``full_config`` the model's."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.full_config = cfg
        self.tp = tp
        cfg = shard_config(cfg, tp.size, tp.rank) if tp is not None else cfg
        self.config = cfg
        self.model = DecoderBody(cfg)
        # their tables are not in the checkpoint: made by ``load_weights``
        self.rotary: Rotary
        self.local_rotary: Rotary | None = None  # a family's local layers' own (Gemma 3)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._tie_head()
        if tp is not None and tp.size > 1:
            for module in self.modules():
                if isinstance(module, Attention | MLP | MoE):
                    module.reduce = tp.reduce
            for module in self.modules():
                if isinstance(module, MoE):  # the mixture sums its experts, then reduces once
                    for expert in module.experts:
                        expert.reduce = None

    @property
    def has_moe(self) -> bool:
        return bool(self.config.moe_layers) and any(self.config.moe_layers)

    def use_fixed_ops(self) -> None:
        """Run the norms, the rotary embedding and the gated activations as
        ``pd.model.fixed_ops``' opaque operators (built already: ``fixed_ops.available()``), so
        that a compiled step computes them as the eager forward does."""
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
        body, cfg = self.model, self.config
        h = body.embed_tokens(batch.input_ids)  # [T, hidden]
        if cfg.embed_scale is not None:  # as HF: the scale rounded to the weights' dtype
            h = h * torch.tensor(cfg.embed_scale, dtype=h.dtype)
        rope = self.rotary(batch.positions, h.dtype)
        local = self.local_rotary(batch.positions, h.dtype) if self.local_rotary else rope
        attn.init_forward_metadata(batch)
        for i, layer in enumerate(body.layers):
            h = layer(h, local if layer.self_attn.uses_local_rope else rope, batch, pool, attn)
            if batch.on_layer_done is not None:
                batch.on_layer_done(i)
        if batch.logits_indices is not None:
            h = h[batch.logits_indices]
        return body.norm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(h).float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load an HF-named state dict (mapped to this decoder's names by the family:
        ``families.to_decoder_weights``); a tied checkpoint's duplicate ``lm_head`` is dropped.
        The tensors become the parameters (no copy), a family's ``1 + weight`` norms get their
        1 folded in, and the rotary tables are computed here, on their device: the model is
        built on the meta device, where building the tables in ``__init__`` (or ``to_empty``)
        ran torch's Python meta kernels, whose first call imports torch._dynamo and sympy,
        seconds of a node's start."""
        cfg = self.config
        tied = cfg.tie_word_embeddings
        if tied:
            weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
        mapped = to_decoder_weights(
            self.full_config.architecture, self.full_config.sandwich_norms, weights
        )
        if self.tp is not None:
            mapped = shard_weights(self.full_config, mapped, self.tp.rank, self.tp.size)
        # assign: a model built on the meta device takes them
        missing, unexpected = self.load_state_dict(mapped, strict=False, assign=True)
        self._tie_head()
        if cfg.norm_offset:
            with torch.no_grad():
                for module in self.modules():
                    if isinstance(module, RMSNorm):
                        module.weight.add_(cfg.norm_offset)
        device = self.model.embed_tokens.weight.device
        self.rotary = Rotary(cfg).to(device)
        if cfg.local_rope_theta is not None:
            self.local_rotary = Rotary(cfg, cfg.local_rope_theta).to(device)
        missing = [k for k in missing if not (tied and k == "lm_head.weight")]
        unexpected = [k for k in unexpected if "rotary_emb" not in k]
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not fit {cfg.architecture}: "
                f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
            )
