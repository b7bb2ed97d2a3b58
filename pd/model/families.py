"""The model families pd serves, each as its differences from Llama: what its ``config.json``
sets (``config_fields``, the fields of a ``pd.model.config.ModelConfig``) and how its checkpoint
names its weights (``to_decoder_weights``). The decoder they all run is ``pd.model.decoder``.
``_FAMILY_KNOBS`` is the registry: a new family is one entry there.

    family       architectures                     differs from Llama by
    Llama        Llama (SmolLM2 too)               -
    Mistral      Mistral                           a sliding window (v0.1), every layer
    Qwen2        Qwen2                             q/k/v biases; a sliding window if asked
    Qwen3        Qwen3                             an RMSNorm over each q and k head
    Gemma 2      Gemma2                            embeddings times sqrt(hidden); norms of 1 + w;
                                                   GeGLU; norms after attention and around the
                                                   MLP; scores scaled by query_pre_attn_scalar and
                                                   soft-capped, logits soft-capped; sliding-window
                                                   layers between global ones
    Gemma 3      Gemma3 (text)                     Gemma 2's, with q/k norms instead of score
                                                   capping, and local layers rotating by their own
                                                   theta
    Phi-3        Phi3                              q/k/v and gate/up fused in the checkpoint; a
                                                   sliding window; partial rotary
    Mixtral      Mixtral                           mixture of experts: softmax, top-k, renormalized
    Qwen3-MoE    Qwen3Moe                          Qwen3's attention; mixture of experts: softmax,
                                                   top-k, renormalized if norm_topk_prob
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


def config_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``ModelConfig`` fields of an HF ``config.json``; ValueError naming what pd does not
    serve."""
    arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r}; pd serves: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    rope = _rope(cfg)
    base: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg.get("intermediate_size") or 0,
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        rope_scaling=_scaling(rope),
    )
    base.update(_FAMILY_KNOBS[arch](cfg, base))
    return base


def _rope(cfg: dict[str, Any], layer_type: str = "full_attention") -> dict[str, Any]:
    """rope_parameters (transformers >= 5: per layer type for some families) or the older
    rope_scaling, with theta in it."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if layer_type in rope:  # one set per layer type
        rope = dict(rope[layer_type])
    return rope


def _scaling(rope: dict[str, Any]) -> dict[str, Any] | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    return {**{k: v for k, v in rope.items() if k != "partial_rotary_factor"}, "rope_type": kind}


def _windows(cfg: dict[str, Any], num_layers: int, every_layer: bool = False) -> tuple[int, ...]:
    """Each layer's sliding window (0: none): ``layer_types`` say which layers slide; a family
    without them slides every layer when it has a window (``every_layer``)."""
    window = cfg.get("sliding_window") or 0
    types = cfg.get("layer_types")
    if types:
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    return (window if every_layer else 0,) * num_layers


def _none(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    return {}


def _mistral(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    return {"layer_windows": _windows(cfg, base["num_layers"], every_layer=True)}


def _qwen2(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    if not cfg.get("use_sliding_window"):
        return {}
    return {"layer_windows": _windows(cfg, base["num_layers"], every_layer=True)}


def _qwen3(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    windows = _windows(cfg, base["num_layers"]) if cfg.get("use_sliding_window") else ()
    return {"qk_norm": True, "layer_windows": windows}


def _gemma(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu"):
        raise ValueError(f"unsupported Gemma activation {act!r}; supported: gelu_pytorch_tanh")
    knobs: dict[str, Any] = {
        "norm_offset": 1.0,
        "embed_scale": math.sqrt(base["hidden_size"]),
        "activation": "gelu_tanh",
        "sandwich_norms": True,
        "query_scale": float(cfg.get("query_pre_attn_scalar") or base["head_dim"]) ** -0.5,
        "attn_softcap": cfg.get("attn_logit_softcapping"),
        "final_softcap": cfg.get("final_logit_softcapping"),
        "layer_windows": _windows(cfg, base["num_layers"]),
    }
    if base["architecture"] == "Gemma3ForCausalLM":
        local = _rope(cfg, "sliding_attention")
        if _scaling(local) is not None:
            raise ValueError(f"unsupported rope scaling of Gemma 3's local layers: {local}")
        knobs["qk_norm"] = True
        knobs["local_rope_theta"] = float(local.get("rope_theta", 10000.0))
    return knobs


def _phi3(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    factor = float(_rope(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    return {
        "layer_windows": _windows(cfg, base["num_layers"], every_layer=True),
        "rotary_dim": int(base["head_dim"] * factor) if factor < 1.0 else 0,
    }


def _moe(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    n = base["num_layers"]
    if base["architecture"] == "MixtralForCausalLM":
        return {
            "layer_windows": _windows(cfg, n, every_layer=True),
            "moe_layers": (True,) * n,
            "num_experts": cfg["num_local_experts"],
            "num_experts_per_tok": cfg["num_experts_per_tok"],
            "moe_intermediate_size": base["intermediate_size"],
            "norm_topk_prob": True,
        }
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
    experts = cfg.get("num_experts", cfg.get("num_local_experts", 0))
    layers = tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(n))
    return {
        **_qwen3(cfg, base),
        "moe_layers": layers,
        "num_experts": experts,
        "num_experts_per_tok": cfg["num_experts_per_tok"],
        "moe_intermediate_size": cfg["moe_intermediate_size"],
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
    }


# The registry: an architecture pd serves -> its knobs (what differs from Llama)
_FAMILY_KNOBS: dict[str, Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]] = {
    "LlamaForCausalLM": _none,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Gemma2ForCausalLM": _gemma,
    "Gemma3ForCausalLM": _gemma,
    "Phi3ForCausalLM": _phi3,
    "MixtralForCausalLM": _moe,
    "Qwen3MoeForCausalLM": _moe,
}
SUPPORTED_ARCHITECTURES = tuple(_FAMILY_KNOBS)

# decoder parameter -> the HF parameters concatenated (along output rows) into it
_FUSED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# HF Gemma names its norms by place; the decoder by role (pd.model.decoder.DecoderLayer).
# Applied in this order: post_attention's new name must be taken before pre_feedforward's
# becomes post_attention.
_GEMMA_NORMS = {
    ".post_attention_layernorm.": ".attn_out_norm.",
    ".pre_feedforward_layernorm.": ".post_attention_layernorm.",
    ".post_feedforward_layernorm.": ".mlp_out_norm.",
}


# Mixtral's checkpoints name an expert's projections w1 (gate), w3 (up), w2 (down)
_MIXTRAL_NAMES = {
    ".block_sparse_moe.": ".mlp.",
    ".w1.": ".gate_proj.",
    ".w3.": ".up_proj.",
    ".w2.": ".down_proj.",
}


def _renamed(name: str, renames: dict[str, str]) -> str:
    for theirs, ours in renames.items():
        name = name.replace(theirs, ours)
    return name


def to_decoder_weights(
    architecture: str, sandwich_norms: bool, weights: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """An HF-named state dict -> the decoder's names: q/k/v and gate/up concatenated into the
    fused projections (a checkpoint that stores them fused, as Phi-3's, is kept as it is),
    Gemma's norms renamed by role, a mixture of experts' stacked experts split one module
    each. A part that is missing leaves the others as they are, so loading reports them."""
    renames = (
        _GEMMA_NORMS if sandwich_norms
        else _MIXTRAL_NAMES if architecture == "MixtralForCausalLM"
        else {}
    )  # fmt: skip
    out = {_renamed(name, renames): t for name, t in weights.items()}
    for fused, parts in _FUSED_PROJECTIONS.items():
        for name in list(out):
            prefix, sep, suffix = name.rpartition(f".{parts[0]}.")
            names = [f"{prefix}.{part}.{suffix}" for part in parts]
            if sep and all(n in out for n in names):
                out[f"{prefix}.{fused}.{suffix}"] = torch.cat([out.pop(n) for n in names])
    for name in [n for n in out if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        stacked = out.pop(name)  # [num_experts, out, in]
        prefix, _, proj = name.rpartition(".")
        for e in range(stacked.shape[0]):
            out[f"{prefix}.{e}.{proj}.weight"] = stacked[e]
    return out
