"""pd's batch-invariant matmul (``torch.ops.pd.fixed_mm``): a row's output has the same bits
whatever the other rows, their number, the thread count and the CPU's vector width.

Exact by construction, not by observation: every output element is one chain of fused
multiply-adds over the inputs in their order, ``acc = fma(x[m, k], w[n, k], acc)`` for
``k = 0 .. K - 1`` from 0.0, then (int8) one multiply by its column's scale. No split of K, no
blocking of K that depends on M, no reordering for the vector width: the weight is packed so
that output columns lie in vector lanes (``pack``: blocks of ``COLS`` columns, each k's weights
side by side), a lane holds one column's chain, and threads share (block of columns, run of
rows) tasks, which only decide who computes a chain, never how. A lane of 16 (AVX-512), 8
(AVX2 with FMA) or 1 (scalar ``std::fma``) computes the same chain, so every ISA level gives
the same bits too (tests/model/test_deterministic.py checks each level the CPU can be capped
to with ``PD_CPU_ISA``).

Weights in fp32, bf16, fp16 or int8 (a scale per output column) are converted to fp32 in
registers as they are loaded (all exactly), inputs to fp32 once (exact for bf16 and fp16);
the output is fp32. Register blocking: 6 rows x 32 columns (AVX-512) or 3 x 32 (AVX2) of
accumulators, the block's weights read once for those rows.

``torch.ops.pd.fixed_mm(x, weight, scale, n)``: x [M, K], ``pack``'s weight [blocks, K, COLS]
and int8's scale [blocks * COLS] fp32 (None otherwise) -> x @ W^T, [M, n] fp32; ValueError,
with the numbers, for inputs off the weight's shape. Built by ``pd.core.cpp.load_torch_ops``
(``available`` is False where it cannot be built).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pd.core import cpp

COLS = 32  # output columns of a packed block
FORMATS = (torch.float32, torch.bfloat16, torch.float16, torch.int8)
_SOURCE = Path(__file__).with_suffix(".cpp").read_text()  # the C++ beside this module


@functools.cache
def _library() -> ctypes.CDLL | None:
    return cpp.load_torch_ops("gemm", _SOURCE, {"pd::fixed_mm": _fake_fixed_mm})


def available() -> bool:
    """Whether the kernel is built and registered here (a C++ compiler is all it needs)."""
    return _library() is not None


def lanes() -> int:
    """The vector width the built kernel runs: 16 (AVX-512), 8 (AVX2 with FMA), 1 (scalar)."""
    lib = _library()
    assert lib is not None, "the fixed matmul is not built here"
    return int(lib.pd_gemm_lanes())


def pack(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """weight: [N, K] -> [ceil(N / COLS), K, COLS] in ``dtype`` (default: the weight's), the
    last block's missing columns zero."""
    dtype = dtype or weight.dtype
    if dtype not in FORMATS:
        raise ValueError(f"the fixed matmul takes weights in {FORMATS}, got {dtype}")
    n, k = weight.shape
    blocks = -(-n // COLS)
    padded = weight.new_zeros(blocks * COLS, k, dtype=dtype)
    padded[:n] = weight.to(dtype)
    return padded.view(blocks, COLS, k).transpose(1, 2).contiguous()


def pack_scale(scale: torch.Tensor) -> torch.Tensor:
    """int8's scale per output column [N] -> fp32 [blocks * COLS], padded with ones."""
    n = scale.shape[0]
    out = torch.ones(-(-n // COLS) * COLS, dtype=torch.float32)
    out[:n] = scale.float()
    return out


def _fake_fixed_mm(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, n: int
) -> torch.Tensor:  # the output's shape, for tracing
    return x.new_empty(x.shape[0], n, dtype=torch.float32)
