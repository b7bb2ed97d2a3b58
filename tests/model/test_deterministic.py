"""Every deterministic linear gives a row the bits it gets alone, at any number of rows and any
thread count, on the machine the suite runs on (``quantize_linears(..., deterministic=True)``;
the CPU behind the machine changes between runs, so each run checks its own); the fixed ops give
the same bits in a compiled graph as out of one, near torch's own ops. Controls show what the deterministic choices avoid:
int4's dense copy from 128 rows on, oneDNN's bf16 GEMM past 32 rows, its fp32 GEMM at one row."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pd.model import fixed_ops, int4_kernel
from pd.model.quant import (
    DEQUANT_MIN_TOKENS,
    Fp16Linear,
    Int4Linear,
    Int8Linear,
    OneDNNLinear,
    onednn_has_bf16,
)

# (in, out): SmolLM2's q/k/v, its down projection (a lone fp32 row differs there), its head
SHAPES = [(576, 960), (1536, 576), (576, 8192)]
ROW_COUNTS = [1, 2, 3, 5, 8, 17, 31, 32, 33, 64, 127, 128, 129, 300]


def _linear(shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> nn.Linear:
    torch.manual_seed(sum(shape))
    return nn.Linear(*shape, bias=False).to(dtype)


def _rows_that_differ(layer: nn.Module, x: torch.Tensor) -> dict[tuple[int, int], int]:
    """(threads, row count) -> how many rows differ from the same rows multiplied alone."""
    before = torch.get_num_threads()
    out = {}
    try:
        torch.set_num_threads(1)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in ROW_COUNTS:
                num = int((layer(x[:m]) != alone[:m]).any(-1).sum())
                if num:
                    out[(threads, m)] = num
    finally:
        torch.set_num_threads(before)
    return out


def _make(kind: str, shape: tuple[int, int]) -> tuple[nn.Module, torch.dtype]:
    if kind == "bf16":
        return OneDNNLinear(_linear(shape, torch.bfloat16), deterministic=True), torch.bfloat16
    layers = {
        "int4 pd": lambda lin: Int4Linear(lin, kernel="pd", dense_min_tokens=None),
        "int4 torch": lambda lin: Int4Linear(lin, kernel="torch", dense_min_tokens=None),
        "int8": lambda lin: Int8Linear(lin, dense_min_tokens=None),
        "fp16": Fp16Linear,
        "fp32": lambda lin: OneDNNLinear(lin, deterministic=True),
    }
    return layers[kind](_linear(shape)), torch.float32


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["int4 pd", "int4 torch", "int8", "fp16", "fp32", "bf16"])
def test_a_deterministic_linear_gives_a_row_its_bits_at_any_row_count(kind, shape):
    if kind == "int4 pd" and not int4_kernel.available():
        pytest.skip("pd's int4 kernel does not build here (no compiler, or no AVX2 with FMA)")
    if kind == "bf16" and not onednn_has_bf16():
        pytest.skip("no oneDNN bf16 path on this CPU")
    layer, dtype = _make(kind, shape)
    x = torch.randn(max(ROW_COUNTS), shape[0], generator=torch.Generator().manual_seed(1))
    assert _rows_that_differ(layer, x.to(dtype)) == {}


def test_the_controls_differ_without_the_deterministic_choices():
    x = torch.randn(300, 1536, generator=torch.Generator().manual_seed(2))
    int4 = Int4Linear(_linear((1536, 576)))  # a dense copy from DEQUANT_MIN_TOKENS rows on
    assert (1, DEQUANT_MIN_TOKENS) in _rows_that_differ(int4, x)
    fp32 = OneDNNLinear(_linear((1536, 576)))  # a lone row: another kernel
    assert _rows_that_differ(fp32, x) != {}
    if onednn_has_bf16():
        bf16 = OneDNNLinear(_linear((1536, 576), torch.bfloat16))
        assert _rows_that_differ(bf16, x.bfloat16()) != {}


def _eager(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    half = x.shape[-1] // 2
    gu = torch.cat((x, x.flip(-1)), dim=-1)
    return (
        F.rms_norm(x, w.shape, w, 1e-5),
        x[:, None] * cos + x[:, None].roll(half, -1) * sin,
        F.silu(gu[..., : x.shape[-1]]) * gu[..., x.shape[-1] :],
    )


def _fixed(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    gu = torch.cat((x, x.flip(-1)), dim=-1)
    return (
        torch.ops.pd.rms_norm(x, w, 1e-5),
        torch.ops.pd.rotary(x[:, None], cos, sin),
        torch.ops.pd.silu_mul(gu),
    )


@pytest.mark.skipif(not fixed_ops.available(), reason="no C++ compiler to build the fixed ops")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fixed_ops_give_their_bits_in_a_compiled_graph_too_near_torchs(dtype):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 80, generator=g), torch.rand(80, generator=g) + 0.5
    cos, sin = torch.randn(5, 1, 80, generator=g), torch.randn(5, 1, 80, generator=g)
    args = [t.to(dtype) for t in (x, w, cos, sin)]
    eager = _fixed(*args)
    compiled = torch.compile(_fixed, fullgraph=True)(*args)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for got, want in zip(eager, _eager(*args)):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    rows = torch.cat([torch.ops.pd.rms_norm(args[0][i : i + 1], args[1], 1e-5) for i in range(5)])
    assert torch.equal(rows, eager[0])  # a row alone: its bits
