"""Attention backends behind ``pd.core.attention.BaseAttentionBackend``: ``KernelAttentionBackend``
(every row on ``pd.executor.cpu_attention``'s C++ kernel: the CPU's deterministic path),
``TorchAttentionBackend`` (SDPA, the reference on CPU and GPU, with a batch's one-token decode
rows on the C++ kernel where it builds) and ``PagedDecodeAttention`` (what a compiled decode step
traces)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pd.core.attention import AttentionSpec, BaseAttentionBackend
from pd.core.batch import DecodeBatch, ForwardBatch
from pd.core.kv_pool import KVPool
from pd.executor import cpu_attention


class _DecodeMeta(NamedTuple):
    idx: torch.Tensor  # [B, max_len] slot per key, padded with a valid slot
    mask: torch.Tensor | None  # [B, max_len] True where a key is real; None if no padding


class _ExtendMeta(NamedTuple):
    q_bounds: list[tuple[int, int]]  # flat token range of each extend request
    # [n, seq_len] bool, or None: causal (a cold prefill, or one padded below)
    masks: list[torch.Tensor | None]
    # query rows of zeros put before the request's own, one per cached token, so that a short
    # prefix runs SDPA's causal kernel (faster than an explicit mask); their rows of the
    # output are dropped. 0: none (a cold prefill, or a prefix under an explicit mask)
    pads: list[int]
    kv_slots: list[torch.Tensor]


class _Meta(NamedTuple):
    """A batch's leading one-token rows (``num_decode`` of them) attend in one padded SDPA;
    the extend rows after them one SDPA each."""

    num_decode: int
    decode: _DecodeMeta | None
    extend: _ExtendMeta


class _RowMeta(NamedTuple):
    """Every row of a batch by the kernel's ragged op: row t attends to the keys
    ``slots[starts[t] : starts[t] + lens[t]]``."""

    slots: torch.Tensor  # [sum of seq_lens] int64: each request's slots, one after another
    starts: torch.Tensor  # [T] int64: where row t's request's slots begin
    lens: torch.Tensor  # [T] int64: how many keys row t sees (its position + 1)


def row_meta(batch: ForwardBatch) -> _RowMeta:
    """``_RowMeta`` of a batch: request r's rows see its prefix and its new tokens up to
    their own, causally."""
    starts: list[int] = []
    lens: list[int] = []
    offset = 0
    for n, seq_len in zip(batch.extend_lens, batch.seq_lens):
        starts += [offset] * n
        lens += range(seq_len - n + 1, seq_len + 1)
        offset += seq_len
    device = batch.input_ids.device
    return _RowMeta(
        torch.cat(batch.kv_slots),
        torch.tensor(starts, dtype=torch.int64, device=device),
        torch.tensor(lens, dtype=torch.int64, device=device),
    )


_FULL = AttentionSpec(0.0)  # the op's defaults: 1 / sqrt(head dim), no cap, every key


class KernelAttentionBackend(BaseAttentionBackend):
    """Every row of a batch, prefill and decode alike, by ``pd.executor.cpu_attention``'s ragged
    op, each row computed as it would be alone: the deterministic path (CPU, bf16 or fp32), and
    the one reader of an int8 pool's codes and scales (``--kv-cache-dtype int8``).
    ``specs``: each layer's scale, score cap and window (none: every layer the defaults)."""

    def __init__(self, specs: Sequence[AttentionSpec] = ()) -> None:
        self.specs = list(specs)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        batch.attn_metadata = row_meta(batch)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        pool: KVPool,
    ) -> torch.Tensor:
        pool.write(layer, batch.out_slots, k, v)
        rows: _RowMeta = batch.attn_metadata
        spec = self.specs[layer] if self.specs else _FULL
        return torch.ops.pd.paged_attention(
            q, pool.k[layer], pool.v[layer], rows.slots, rows.starts, rows.lens, *spec
        )


class TorchAttentionBackend(BaseAttentionBackend):
    """One padded SDPA per layer for the batch's decode rows (the C++ kernel where it runs),
    one SDPA per extend request; a layer with a sliding window attends under an explicit mask,
    one with capped scores by plain torch math (SDPA caps nothing)."""

    def __init__(
        self,
        kernel: bool = True,
        extend_dtype: torch.dtype | None = None,
        extend_min_tokens: int = 1,
        specs: Sequence[AttentionSpec] = (),
    ) -> None:
        self.specs = list(specs)
        # whether decode rows may run on the kernel; None: decided at the first decode rows,
        # from their dtype and heads
        self._kernel: bool | None = None if kernel else False
        # the dtype a request's extend rows attend in when it has at least
        # ``extend_min_tokens`` of them (q, k and v cast to it, the output cast back); None:
        # the model's
        self.extend_dtype = extend_dtype
        self.extend_min_tokens = extend_min_tokens

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        nd = 0
        while nd < batch.num_reqs and batch.extend_lens[nd] == 1:
            nd += 1
        device = batch.input_ids.device
        decode = self._decode_meta(batch.seq_lens[:nd], batch.kv_slots[:nd], device) if nd else None
        bounds, masks, pads = [], [], []
        start = nd
        for n, seq_len in zip(batch.extend_lens[nd:], batch.seq_lens[nd:]):
            bounds.append((start, start + n))
            start += n
            prefix = seq_len - n
            # a prefix up to a quarter of the new tokens: pad (its zero rows cost less than a
            # mask: scripts/bench_attention.py --extend)
            pad = 4 * prefix <= n
            pads.append(prefix if pad else 0)
            if pad:
                masks.append(None)
            else:
                # query i sits at position prefix + i and sees keys [0, prefix + i]
                masks.append(_causal(n, seq_len, device))
        extend = _ExtendMeta(bounds, masks, pads, batch.kv_slots[nd:])
        batch.attn_metadata = _Meta(nd, decode, extend)

    @staticmethod
    def _decode_meta(
        seq_lens: list[int], kv_slots: list[torch.Tensor], device: torch.device
    ) -> _DecodeMeta:
        if len(set(seq_lens)) == 1:
            return _DecodeMeta(torch.stack(kv_slots), None)
        max_len = max(seq_lens)
        idx = torch.zeros(len(seq_lens), max_len, dtype=torch.int64, device=device)
        for r, slots in enumerate(kv_slots):
            idx[r, : slots.shape[0]] = slots
        lens = torch.tensor(seq_lens, device=device)
        mask = torch.arange(max_len, device=device)[None, :] < lens[:, None]
        return _DecodeMeta(idx, mask)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        pool: KVPool,
    ) -> torch.Tensor:
        pool.write(layer, batch.out_slots, k, v)
        meta: _Meta = batch.attn_metadata
        spec = self.specs[layer] if self.specs else _FULL
        if meta.decode is not None and meta.num_decode == q.shape[0]:
            return self._decode(q, layer, pool, meta.decode, spec)
        out = torch.empty_like(q)
        if meta.decode is not None:
            decode = self._decode(q[: meta.num_decode], layer, pool, meta.decode, spec)
            out[: meta.num_decode] = decode
        ext = meta.extend
        for (start, end), mask, pad, slots in zip(ext.q_bounds, ext.masks, ext.pads, ext.kv_slots):
            qr = q[start:end]
            if spec.window:  # the band of keys each row sees: an explicit mask, no padding
                seq_len, n = slots.shape[0], end - start
                mask = _causal(n, seq_len, q.device, spec.window)
                pad = 0
            if mask is None and not pad:  # cold prefill: the keys are this batch's new tokens
                kr, vr = k[start:end], v[start:end]
            else:
                kr, vr = pool.k[layer][slots], pool.v[layer][slots]
            if pad:  # query row j of the padded rows sits at position j, as causal assumes
                qr = torch.cat((qr.new_zeros(pad, *qr.shape[1:]), qr))
            if self.extend_dtype is not None and end - start >= self.extend_min_tokens:
                qr, kr, vr = (t.to(self.extend_dtype) for t in (qr, kr, vr))
            o = _attend(qr.transpose(0, 1)[None], kr.transpose(0, 1)[None],  # [1, H, rows, D]
                        vr.transpose(0, 1)[None], mask, spec)  # fmt: skip
            out[start:end] = o[0, :, pad:].transpose(0, 1).to(out.dtype)
        return out

    def _decode(
        self,
        q: torch.Tensor,
        layer: int,
        pool: KVPool,
        meta: _DecodeMeta,
        spec: AttentionSpec = _FULL,
    ) -> torch.Tensor:
        k_cache, v_cache = pool.k[layer], pool.v[layer]
        if self._kernel is None:
            self._kernel = cpu_attention.available(
                q.dtype, q.device, q.shape[1], *k_cache.shape[1:]
            )
        mask = meta.mask if meta.mask is not None else torch.ones_like(meta.idx, dtype=torch.bool)
        if self._kernel:
            return torch.ops.pd.paged_decode_attention(q, k_cache, v_cache, meta.idx, mask, *spec)
        # q: [B, H, D] -> [B, H, 1, D]; keys: [B, KVH, max_len, D]. index_select: ~5x faster
        # than advanced indexing on CPU
        shape = (*meta.idx.shape, *pool.k[layer].shape[1:])
        flat_idx = meta.idx.view(-1)
        keys = pool.k[layer].index_select(0, flat_idx).view(shape).transpose(1, 2)
        values = pool.v[layer].index_select(0, flat_idx).view(shape).transpose(1, 2)
        if spec.window:  # the last ``window`` of each row's keys
            lens = mask.sum(-1, keepdim=True)
            mask = mask & (torch.arange(mask.shape[1], device=mask.device) >= lens - spec.window)
        full = meta.mask is None and not spec.window
        out = _attend(
            q[:, :, None, :], keys, values, None if full else mask[:, None, None, :], spec
        )
        return out[:, :, 0, :].to(q.dtype)


def _causal(n: int, seq_len: int, device: torch.device, window: int = 0) -> torch.Tensor:
    """[n, seq_len] bool: the last n of seq_len positions each see the keys up to their own
    (only the last ``window`` of them where ``window`` > 0)."""
    prefix = seq_len - n
    mask = torch.ones(n, seq_len, dtype=torch.bool, device=device).tril(prefix)
    return mask.triu(prefix - window + 1) if window else mask


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    spec: AttentionSpec,
) -> torch.Tensor:
    """SDPA over [B, H, rows, D] (``mask`` None: causal), with ``spec``'s scale; capped scores
    (which SDPA cannot do) by plain torch math in fp32."""
    scale = spec.scale or None
    if not spec.softcap:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = q.float() @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / spec.softcap) * spec.softcap
    if mask is None:
        mask = _causal(q.shape[-2], k.shape[-2], q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v).to(q.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    idx: torch.Tensor,
    mask: torch.Tensor,
    scale: float = 0.0,
    softcap: float = 0.0,
    window: int = 0,
) -> torch.Tensor:
    """One query per row over its keys in the pool, written as plain gathers, products and
    sums so that inductor fuses the gather, the scores, the softmax and the weighted sum into a
    few loops (no [B, L] copy of the keys, no SDPA call: on CPU, SDPA with one query ran 4-8x
    slower, and in bf16 it ran in a slow path). Scores and softmax are fp32 in every dtype.

    q: [B, H, D]; k_cache, v_cache: [num_slots, KVH, D]; idx, mask: [B, L]; -> [B, H, D];
    ``scale``, ``softcap``, ``window`` as ``AttentionSpec``'s (0: the defaults). Eager, this
    materialises [B, L, KVH, G, D] products: only compiled code should call it.
    """
    b, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    keys = k_cache[idx][:, :, :, None, :]  # [B, L, KVH, 1, D]
    values = v_cache[idx][:, :, :, None, :]
    query = q.view(b, 1, num_kv_heads, group, head_dim).float()
    scores = (query * keys.float()).sum(-1) * (scale or head_dim**-0.5)  # [B, L, KVH, G]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if window:  # the last ``window`` of each row's keys
        lens = mask.sum(-1, keepdim=True)
        mask = mask & (torch.arange(mask.shape[1], device=mask.device) >= lens - window)
    scores = scores.masked_fill(~mask[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1)
    out = (probs[..., None] * values.float()).sum(1)  # [B, KVH, G, D]
    return out.reshape(b, num_heads, head_dim).to(q.dtype)


class PagedDecodeAttention(BaseAttentionBackend):
    """Attention of a ``DecodeBatch`` (one query per row, keys by slot index): the backend a
    compiled decode step traces. Its batch carries its own index tensors, so there is no
    metadata to build. ``kernel``: call ``pd.executor.cpu_attention``'s op (an opaque call in
    the graph) instead of tracing ``paged_decode_attention``."""

    def __init__(self, kernel: bool = False, specs: Sequence[AttentionSpec] = ()) -> None:
        self.kernel = kernel
        self.specs = list(specs)

    def init_forward_metadata(self, batch: DecodeBatch) -> None:  # type: ignore[override]
        pass

    def forward(  # type: ignore[override]
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        batch: DecodeBatch,
        pool: KVPool,
    ) -> torch.Tensor:
        pool.write(layer, batch.out_slots, k, v)
        attend = torch.ops.pd.paged_decode_attention if self.kernel else paged_decode_attention
        spec = self.specs[layer] if self.specs else _FULL
        return attend(q, pool.k[layer], pool.v[layer], batch.kv_idx, batch.kv_mask, *spec)


def make_attention_backend(
    name: str,
    device: torch.device,
    extend_dtype: torch.dtype | None = None,
    extend_min_tokens: int = 1,
    every_row_on_kernel: bool = False,
    specs: Sequence[AttentionSpec] = (),
) -> BaseAttentionBackend:
    """``auto``: SDPA, decode rows on the C++ kernel where it runs; ``torch``: SDPA alone.
    ``extend_dtype``: the dtype a request's prefill or extend rows attend in, if not the
    model's, where it has at least ``extend_min_tokens`` of them. ``every_row_on_kernel``
    (``auto`` only): every row on the kernel (``KernelAttentionBackend``, deterministic).
    ``specs``: each layer's scale, score cap and window."""
    if name == "auto" and every_row_on_kernel:
        return KernelAttentionBackend(specs)
    if name in ("auto", "torch"):
        return TorchAttentionBackend(name == "auto", extend_dtype, extend_min_tokens, specs)
    raise ValueError(f"unknown attention backend {name!r}; available: auto, torch")
