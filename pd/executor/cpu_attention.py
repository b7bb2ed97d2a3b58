"""Attention on the CPU as one C++ kernel for every row: decode rows, prefill rows, chunks.

Torch has no CPU kernel for paged attention, and its SDPA gives a query row other bits
depending on how many rows come with it and how its keys were split. This kernel computes each
query row from its query and its keys alone, in their order, so that a token's attention (and
so its KV in the next layer, and every answer that reads it) has the same bits whether it was
decoded or prefilled, alone or in a batch, in one chunk or several, here or on another node:
the deterministic path (``EngineConfig.deterministic``).

Per task (up to ``kRows`` query rows of one request, one KV head, all their query heads):
keys go through in blocks of 16, transposed into columns so that one fma adds a dim of 16 keys'
scores at once (each score is a chain of fma over the head dim); the best score, the
exp (a polynomial, every step spelled out), the softmax's sum over 16 lanes in a fixed order,
then the values weighted in key order by fma. Rows of one request share each block of keys
(prefill runs like a small GEMM); tasks run on torch's OpenMP threads. With AVX-512 the loops
are intrinsics; elsewhere plain loops the compiler vectorizes, with the same arithmetic: an
AVX2 build gives the AVX-512 build's bits (tests/executor/test_cpu_attention.py). Speed beside
SDPA and the kernel it replaced: BENCHMARKS.md, "Deterministic inference".

bf16 and fp32 pools alike (scores and sums in fp32), and int8 pools (``--kv-cache-dtype
int8``: each row of a head is its int8 codes then its fp32 scale, dequantized as it is loaded,
code times scale, one rounding); any head dim, any number of query heads per KV head. Built from cpu_attention.cpp (beside this module) on first use with the machine's C++ compiler (cached
under ``PD_CACHE_DIR/kernels``, ``pd.core.cpp``); it registers two torch operators, which a
compiled graph calls through torch's dispatcher:

- ``torch.ops.pd.paged_attention(q, k_cache, v_cache, slots, starts, lens)``: q [T, H, D]; the
  caches [num_slots, KVH, D]; slots [N]; starts, lens [T]: row t attends to the keys
  ``slots[starts[t] : starts[t] + lens[t]]`` -> [T, H, D] in q's dtype (every row of a batch).
- ``torch.ops.pd.paged_decode_attention(q, k_cache, v_cache, idx, mask)``: q [B, H, D]; idx
  [B, L] slots; mask [B, L], True where the key is the row's (a compiled decode step's padded
  rows; a row with no key gives zeros).
- ``torch.ops.pd.kv_quantize(x)``: x [N, KVH, D] fp32 or bf16 -> [N, KVH, D + 4] int8, each
  row's codes then its scale's bytes (``quantize``): a row's bytes depend on its values alone.

Each cache is [num_slots, KVH, D] in q's dtype or [num_slots, KVH, D + 4] int8.

Shapes and dtypes it does not take raise ``ValueError`` with the numbers; a slot outside the
pool raises ``IndexError`` (the kernel skips it rather than read out of bounds). Without a
compiler, or for a dtype or device it does not take, ``available`` is False.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pd.core import cpp
from pd.core.kv_pool import KV_SCALE_BYTES as SCALE_BYTES

_SOURCE = Path(__file__).with_suffix(".cpp").read_text()  # the C++ beside this module


_DTYPES = (torch.bfloat16, torch.float32)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernel, its ops registered, or None where it cannot be built (logged once)."""
    fakes = {
        "pd::paged_decode_attention": _fake_attention,
        "pd::paged_attention": _fake_attention,
        "pd::kv_quantize": _fake_quantize,
    }
    return cpp.load_torch_ops("attention", _SOURCE, fakes)


def available(
    dtype: torch.dtype, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int
) -> bool:
    """Whether the kernel runs for these heads, ``dtype`` and ``device`` (cpu; bf16 or fp32;
    any head dim, as many query heads per KV head as divide evenly)."""
    if device.type != "cpu" or dtype not in _DTYPES or num_kv_heads < 1 or head_dim < 1:
        return False
    return num_heads % num_kv_heads == 0 and _library() is not None


def _fake_attention(q: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)  # the output's shape, for tracing


def _fake_quantize(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=torch.int8)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """``x`` [N, KVH, D] (fp32 or bf16) as int8 rows [N, KVH, D + 4]: per token and head,
    scale = absmax / 127 and code = round-half-even(x * (127 / absmax)), then the scale's
    bytes. The op is there once ``available`` said True (what a compiled graph calls)."""
    return torch.ops.pd.kv_quantize(x)


def dequantize(rows: torch.Tensor) -> torch.Tensor:
    """``quantize``'s rows [..., D + 4] back to fp32 [..., D]: code times scale (the kernel's
    arithmetic)."""
    codes = rows[..., :-SCALE_BYTES].float()
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return codes * scale
