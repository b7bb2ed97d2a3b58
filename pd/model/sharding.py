"""Tensor parallelism (Megatron's) of the decoder: how a model of ``size`` ranks splits.

Every rank holds a shard of each layer and computes the same tokens; two sums a layer join
them:

    module          split          rank r holds                          after it
    qkv_proj        by columns     its q heads, its k and v heads        -
    o_proj          by rows        the inputs of its q heads             all-reduce (sum)
    gate_up_proj    by columns     its slice of gate and of up           -
    down_proj       by rows        the inputs of its slice               all-reduce (sum)
    experts         each expert as gate_up / down above                  one all-reduce after
                                                                         their weighted sum
    embedding, norms, router, LM head: whole on every rank (replicated)

Heads: when N is at most the KV heads (KV), rank r holds KV heads ``[r*KV//N, (r+1)*KV//N)``
and the q heads that read them (H/KV per KV head). N need not divide KV: the heads split by
whole KV heads, as evenly as they go (SmolLM2's 3 KV heads over 2 ranks: 1 and 2, with 3 and 6
q heads), and the ranks' slot numbers stay the same. When N exceeds KV (N a multiple of KV that
divides H), rank r has q heads ``[r*H/N, (r+1)*H/N)`` and each KV head is replicated on N/KV
ranks, rank r holding head ``r // (N/KV)`` (vLLM's choice): a q head always finds its KV head
on its rank.

The embedding and LM head stay whole: a vocabulary-parallel head saves each rank
``vocab*hidden*(N-1)/N`` weights but adds a gather of the logits every step, and only rank 0
samples (``pd.parallel.group``); BENCHMARKS.md, "Tensor parallel", has the cost of
each collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch

from pd.model.config import ModelConfig


class TensorParallel(NamedTuple):
    """This process's place in its node: rank ``rank`` of ``size``; ``reduce`` sums a tensor
    over the node's ranks (every rank gets the sum)."""

    rank: int
    size: int
    reduce: Callable[[torch.Tensor], torch.Tensor]


def check_divides(mc: ModelConfig, size: int) -> None:
    """Raise, naming the numbers, unless a node of ``size`` ranks can split ``mc``."""
    if size < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {size}")
    if size == 1:
        return
    problems = []
    h, kv = mc.num_heads, mc.num_kv_heads
    if size > kv and (size % kv or h % size):
        problems.append(
            f"the model's {h} attention heads and {kv} key/value heads (a size up to {kv} "
            f"splits the key/value heads; a larger one must be a multiple of {kv} that "
            f"divides {h})"
        )
    for name, n in (("intermediate", mc.intermediate_size), ("expert", mc.moe_intermediate_size)):
        if n % size:
            problems.append(f"its MLP's {n} {name} columns")
    if problems:
        raise ValueError(
            f"tensor parallel size {size} does not divide {' nor '.join(problems)}; choose a "
            f"size up to {kv}, or a multiple of {kv} that divides {h}"
        )


def shard_config(mc: ModelConfig, size: int, rank: int = 0) -> ModelConfig:
    """The config of rank ``rank``'s shard: its heads and MLP columns (the shapes its modules
    have; the heads of two ranks differ where ``size`` does not divide the KV heads)."""
    check_divides(mc, size)
    if size == 1:
        return mc
    return dataclasses.replace(
        mc,
        num_heads=len(q_heads_of(mc, rank, size)),
        num_kv_heads=len(kv_heads_of(mc.num_kv_heads, rank, size)),
        intermediate_size=mc.intermediate_size // size,
        moe_intermediate_size=mc.moe_intermediate_size // size,
        # the heads' scale is the whole model's (head_dim is kept), so nothing else changes
    )


def kv_heads_of(num_kv_heads: int, rank: int, size: int) -> range:
    """The model's KV heads that rank ``rank`` of ``size`` holds (one, replicated, if the size
    exceeds them)."""
    if size <= num_kv_heads:
        return range(rank * num_kv_heads // size, (rank + 1) * num_kv_heads // size)
    head = rank // (size // num_kv_heads)
    return range(head, head + 1)


def q_heads_of(mc: ModelConfig, rank: int, size: int) -> range:
    """The model's query heads that rank ``rank`` of ``size`` holds: those that read its KV
    heads (a slice of one KV head's where the KV heads are replicated)."""
    h, kv = mc.num_heads, mc.num_kv_heads
    if size <= kv:
        mine = kv_heads_of(kv, rank, size)
        return range(mine.start * (h // kv), mine.stop * (h // kv))
    return range(rank * h // size, (rank + 1) * h // size)


def shard_weights(
    mc: ModelConfig, weights: dict[str, torch.Tensor], rank: int, size: int
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s shard of a decoder-named state dict (``families.to_decoder_weights``)
    of the whole model ``mc``; tensors that stay whole are passed as they are."""
    if size == 1:
        return weights
    d, h = mc.head_dim, mc.num_heads
    q_heads = q_heads_of(mc, rank, size)
    kv_heads = kv_heads_of(mc.num_kv_heads, rank, size)
    # qkv rows: [q heads | k heads | v heads], head_dim rows each
    qkv_rows = torch.cat(
        [
            _rows(q_heads, d),
            _rows(kv_heads, d, offset=h * d),
            _rows(kv_heads, d, offset=(h + mc.num_kv_heads) * d),
        ]
    )
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if ".qkv_proj." in name:
            out[name] = t.index_select(0, qkv_rows).contiguous()
        elif name.endswith(".o_proj.weight"):
            out[name] = t.index_select(1, _rows(q_heads, d)).contiguous()
        elif name.endswith(".gate_up_proj.weight"):
            gate, up = t.chunk(2, dim=0)
            out[name] = torch.cat([_part(gate, 0, rank, size), _part(up, 0, rank, size)])
        elif name.endswith(".down_proj.weight"):
            out[name] = _part(t, 1, rank, size)
        else:
            out[name] = t
    return out


def _rows(heads: range, head_dim: int, offset: int = 0) -> torch.Tensor:
    return torch.arange(
        offset + heads.start * head_dim, offset + heads.stop * head_dim, dtype=torch.int64
    )


def _part(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return t.chunk(size, dim=dim)[rank].contiguous()
