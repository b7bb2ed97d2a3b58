"""int4 matmul by pd's own kernel (``torch.ops.pd.int4_mm``): AVX2, AVX-512 VNNI and AMX
where the CPU has them, every path giving every output the same bits.

torch's int4 op (``aten._weight_int4pack_mm_for_cpu``) is vectorized for AVX-512 only (generic
code elsewhere, about half this kernel's speed) and rounds inputs to bf16; this kernel keeps
16 bits of each input and runs on AVX2 too (docs/bench/history.md, "int4's kernel as a torch operator").

The arithmetic is llama.cpp's for its AVX2 path, with 16-bit activations instead of 8-bit:
each group of 32 inputs of a row of ``x`` is scaled to int16 (``x ~ d * xq``, ``d`` = the
group's largest magnitude / 32767: 2^-15 of it, against bf16's 2^-9 of each value), and
``_mm256_madd_epi16`` multiplies 16 weights by 16 inputs and adds the pairs in int32. The
weights are ``Int4Linear``'s own (``w = (q - 8) * scale + zero``, scale and zero in bf16 per
row and group), so a row's output is, per group, ``scale * (d * sum(q * xq) - 8 * sum(x)) +
zero * sum(x)`` in fp32.

The layout (``pack``) puts 8 output rows in the lanes of a vector: per block of 8 rows and
group, 128 bytes, where 16-byte chunk c holds the input pairs 2c (low nibbles) and 2c + 1 (high
nibbles) of all 8 rows, a row's two inputs side by side. One load, a mask and a shift give 32
weights as int16, the int32 sums of a group come out one per row with no horizontal adds, and
the group's scales and zeros are two 16-byte loads. Each block of rows is read once for all the
rows of ``x`` (up to 4 at a time). Output rows run on torch's OpenMP threads.

With AVX-512 VNNI, pairs of blocks (16 output rows) go through ``block16``: each group's
weights are widened to int16 once per block pair and ``_mm512_dpwssd_epi32`` multiplies them
by the rows of x; the int32 sums are exact and the fp32 steps after them are the AVX2 path's,
so both paths give each output the same bits (tests/model/test_int4_kernel.py), and a row's
output never depends on the other rows of x: the deterministic engine's int4 matmul at every
row count, prefill included.

With AMX (an Intel Xeon's int8 tiles), from 16 rows of x on, each int16 input is split into
its high (signed) and low (unsigned) byte, and per group ``_tile_dpbsud`` and ``_tile_dpbuud``
multiply 16 rows by 16 output rows: ``256 * sum(hi * q) + sum(lo * q)`` is the same exact int32
sum, and the fp32 steps after it are ``block16``'s. Integer sums do not depend on their order,
so every ISA level (``PD_CPU_ISA``) gives the same bits, and which path runs a row count is a
matter of speed alone. Even and odd groups take turns on two pairs of sum tiles, and a group's
fp32 steps are interleaved with the next group's tile loads, multiplies and stores, so the
vector units scale while the tiles multiply; each block pair's weights are widened once for all
the rows of x, and the rows of x are quantized on the threads (each row alone). Those fp32
steps, three fused multiply-adds per output and group of 32 inputs, bound the path: the tiles
cannot sum past a group, whose scale is the weight's own.

Built by ``pd.core.cpp.load_torch_ops`` (with AVX2 and FMA; elsewhere ``available`` is False),
it registers ``pd::int4_mm`` from C++, so a compiled graph calls it through torch's dispatcher
alone (a Python operator calling ctypes would cost tens of microseconds a call).
``torch.ops.pd.int4_mm(x, weight, scale, zero)``: x [M, K] and ``pack``'s three tensors -> x @
W^T, [M, N] fp32; ValueError, with the numbers, for inputs off the weight's shape. ``available``
builds and registers it; ``preferred`` says whether ``Int4Linear`` should use it (wherever it
builds).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pd.core import cpp

ROWS_PER_BLOCK = 8  # output rows per vector; out_features must be a multiple
GROUP_SIZE = 32
_SOURCE = Path(__file__).with_suffix(".cpp").read_text()  # the C++ beside this module


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernel, its op registered, or None where it cannot be built or the CPU lacks
    AVX2 and FMA (the op then raises)."""
    lib = cpp.load_torch_ops("int4_mm", _SOURCE, {"pd::int4_mm": _fake_int4_mm})
    return lib if lib is not None and lib.pd_int4_available() else None


def available() -> bool:
    """Whether the kernel runs on this machine."""
    return _library() is not None


def preferred() -> bool:
    """Whether ``Int4Linear`` should use this kernel rather than torch's: wherever it runs. With
    AVX2 alone torch's op runs generic code (the module's docstring); with AVX-512 VNNI this
    kernel takes 16 output rows a vector and keeps each group's weights in registers for the
    rows of x (BENCHMARKS.md, "CPU weight formats")."""
    return available()


def pack(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q: [N, K] integers 0..15; scale, zero: [N, K / 32] bf16 (``w = (q - 8) * scale +
    zero``) -> (weights [N / 8, K / 32, 128] uint8, scales and zeros [N / 8, K / 32, 8] bf16)
    in the kernel's layout."""
    n, k = q.shape
    if n % ROWS_PER_BLOCK or k % GROUP_SIZE:
        raise ValueError(
            f"the int4 kernel needs out_features % {ROWS_PER_BLOCK} == 0 and in_features % "
            f"{GROUP_SIZE} == 0, got {n} x {k}"
        )
    nb, g = n // ROWS_PER_BLOCK, k // GROUP_SIZE
    # [block, row, group, pair, 2] -> [block, group, pair, row, 2]: a pair's 16 weights
    q = q.to(torch.uint8).view(nb, ROWS_PER_BLOCK, g, 16, 2).permute(0, 2, 3, 1, 4)
    q = q.reshape(nb, g, 8, 2, 16)  # pairs 2c and 2c + 1 of chunk c
    packed = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(nb, g, 128).contiguous()

    def by_block(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).view(nb, ROWS_PER_BLOCK, g).transpose(1, 2).contiguous()

    return packed, by_block(scale), by_block(zero)


def _fake_int4_mm(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> torch.Tensor:  # the output's shape, for tracing
    return x.new_empty(x.shape[0], weight.shape[0] * ROWS_PER_BLOCK, dtype=torch.float32)
