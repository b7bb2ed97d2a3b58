"""Every deterministic linear gives a row the bits it gets alone, at every row count from 1 to
300 and 1 or 2 threads (``quantize_linears(..., deterministic=True)``: pd's own kernels, whose
every output is one fixed chain of operations), at every ISA level this CPU can be capped to
(``PD_CPU_ISA``), and every level gives the same bits as the machine's own; the fixed ops give
the same bits in a compiled graph as out of one, near torch's own ops. Controls show what the
library paths (``--no-deterministic``) do instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pd.core import cpp
from pd.model import fixed_ops, gemm, int4_kernel
from pd.model.quant import DEQUANT_MIN_TOKENS, Int4Linear, OneDNNLinear, quantize_linears

# (in, out): SmolLM2's q/k/v, its down projection, its head
SHAPES = [(576, 960), (1536, 576), (576, 8192)]
MAX_ROWS = 300
KINDS = {  # kind -> (quantization method, the model's dtype)
    "fp32": ("none", torch.float32),
    "bf16": ("none", torch.bfloat16),
    "fp16": ("fp16", torch.float32),
    "int8": ("int8", torch.float32),
    "int4": ("int4", torch.float32),
}
ROOT = Path(__file__).resolve().parents[2]
needs_kernels = pytest.mark.skipif(
    not (gemm.available() and int4_kernel.available()),
    reason="pd's matmuls do not build here (no C++ compiler, or int4's AVX2 with FMA missing)",
)


def _linear(shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> nn.Linear:
    torch.manual_seed(sum(shape))
    return nn.Linear(*shape, bias=False).to(dtype)


def _make(kind: str, shape: tuple[int, int]) -> tuple[nn.Module, torch.dtype]:
    """The deterministic module the engine builds for ``kind`` (a hidden layer, not a head)."""
    method, dtype = KINDS[kind]
    model = nn.Sequential(_linear(shape, dtype))
    return quantize_linears(model, method, deterministic=True)[0], dtype


def _rows_that_differ(
    layer: nn.Module, x: torch.Tensor, counts: range | list[int] = range(1, MAX_ROWS + 1)
) -> dict[tuple[int, int], int]:
    """(threads, row count) -> how many rows differ from the same rows multiplied alone."""
    before = torch.get_num_threads()
    out = {}
    try:
        torch.set_num_threads(1)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in counts:
                num = int((layer(x[:m]) != alone[:m]).any(-1).sum())
                if num:
                    out[(threads, m)] = num
    finally:
        torch.set_num_threads(before)
    return out


def _x(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(MAX_ROWS, shape[0], generator=torch.Generator().manual_seed(1)).to(dtype)


@needs_kernels
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_deterministic_linear_gives_a_row_its_bits_at_any_row_count(kind, shape):
    layer, dtype = _make(kind, shape)
    with torch.inference_mode():
        assert _rows_that_differ(layer, _x(shape, dtype)) == {}


@needs_kernels
def test_the_head_of_a_quantized_model_is_on_the_fixed_matmul_too():
    model = nn.Sequential()
    model.add_module("lm_head", _linear((576, 8192)))
    head = quantize_linears(model, "int4", deterministic=True).lm_head
    assert head.packed.dtype == torch.float16
    with torch.inference_mode():
        assert _rows_that_differ(head, _x((576, 8192), torch.float32), [1, 7, 64, 300]) == {}


# Run in a process built for one ISA level: every kind's rows at a few counts against the same
# rows alone, and the outputs' bits for the parent to compare with its own level's.
_LEVEL_CHECK = """
import json, sys, torch
from tests.model import test_deterministic as t
report = {}
with torch.inference_mode():
    for kind in t.KINDS:
        for shape in t.SHAPES:
            layer, dtype = t._make(kind, shape)
            x = t._x(shape, dtype)
            bad = t._rows_that_differ(layer, x, [1, 2, 5, 6, 7, 13, 47, 48, 49, 96, 300])
            bits = layer(x).float().view(torch.int32)
            report[f"{kind} {shape}"] = [len(bad), int(bits.sum()), int((bits * 7).sum())]
json.dump(report, sys.stdout)
"""


def _level_report(level: str) -> dict[str, list[int]]:
    env = {**os.environ, "PD_CPU_ISA": level}
    out = subprocess.run(
        [sys.executable, "-c", _LEVEL_CHECK],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@needs_kernels
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_isa_level_gives_a_row_its_bits_and_the_same_bits_as_native():
    """Each level this CPU can be capped to builds its own kernels (AVX-512 without AMX, AVX2
    with FMA): rows keep their bits there too, and each level gives every output the bits the
    machine's own level gives it (fma chains and exact integer sums do not depend on the
    vector width)."""
    levels = [level for level in cpp.available_isa_levels() if level not in ("native", "generic")]
    native = _level_report("native")
    assert all(bad == 0 for bad, *_ in native.values()), native
    for level in levels:
        report = _level_report(level)
        assert report == native, (level, report, native)


@needs_kernels
def test_the_scalar_build_of_the_fixed_matmul_gives_the_vector_builds_bits():
    """``generic``: no vectors at all (one lane, std::fma) — the same chain, the same bits."""
    script = (
        "import torch, sys; from pd.model import gemm; assert gemm.available(); "
        "print(gemm.lanes()); w = torch.randn(70, 96, generator=torch.Generator().manual_seed(0)); "
        "x = torch.randn(9, 96, generator=torch.Generator().manual_seed(1)); "
        "y = torch.ops.pd.fixed_mm(x, gemm.pack(w), None, 70); "
        "print(int(y.view(torch.int32).sum()), int((y.view(torch.int32) * 3).sum()))"
    )
    outs = {}
    for level in ("native", "generic"):
        env = {**os.environ, "PD_CPU_ISA": level}
        run = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 0, run.stderr[-3000:]
        outs[level] = run.stdout.split()
    assert outs["generic"][0] == "1" and outs["native"][0] != "1"
    assert outs["generic"][1:] == outs["native"][1:]


def test_the_controls_differ_without_the_deterministic_choices():
    x = torch.randn(300, 1536, generator=torch.Generator().manual_seed(2))
    int4 = Int4Linear(_linear((1536, 576)))  # a dense copy from DEQUANT_MIN_TOKENS rows on
    with torch.inference_mode():
        assert (1, DEQUANT_MIN_TOKENS) in _rows_that_differ(int4, x, [DEQUANT_MIN_TOKENS])
        if torch.backends.mkldnn.is_available():
            fp32 = OneDNNLinear(_linear((1536, 576)))  # oneDNN picks kernels by row count
            assert _rows_that_differ(fp32, x, [1, 2, 17, 33, 64, 300]) != {}


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
