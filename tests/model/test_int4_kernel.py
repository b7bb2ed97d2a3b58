"""pd's int4 matmul (``pd.model.int4_kernel``): the weights ``Int4Linear`` quantized, read back
through the kernel's own layout; products within the bound of its 16-bit inputs; the choice
between it and torch's op; bad shapes refused."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from pd.core import cpp
from pd.model import int4_kernel, quant
from pd.model.quant import Int4Linear

needs_kernel = pytest.mark.skipif(
    not int4_kernel.available(), reason="no C++ compiler with AVX2 and FMA here"
)


def _linear(n: int, k: int, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        linear.weight.normal_(0.0, 0.05)
    return linear


def _exact_weights(lin: Int4Linear) -> torch.Tensor:
    """``(q - 8) * scale + zero`` in fp64, unpacked from the kernel's layout by hand: [N, K]."""
    nb, g, _ = lin.qweight.shape
    b = lin.qweight.view(nb, g, 8, 16)
    q = torch.stack((b & 15, b >> 4), 3)  # [block, group, chunk, lo/hi pair, 16]
    q = q.view(nb, g, 16, 8, 2).permute(0, 3, 1, 2, 4).reshape(nb * 8, g, 32)
    scale = lin.scales.transpose(1, 2).reshape(nb * 8, g, 1).double()
    zero = lin.zeros.transpose(1, 2).reshape(nb * 8, g, 1).double()
    return ((q.double() - 8) * scale + zero).reshape(nb * 8, g * 32)


@needs_kernel
@pytest.mark.timeout(30)
@pytest.mark.parametrize("num_rows", [0, 1, 2, 3, 4, 5, 7, 13])  # the 4-, 2- and 1-row tiles
@pytest.mark.parametrize(("n", "k"), [(8, 32), (96, 128), (40, 1536), (136, 576)])
def test_products_within_the_rounding_of_the_kernels_16_bit_inputs(
    n: int, k: int, num_rows: int
) -> None:
    lin = Int4Linear(_linear(n, k), kernel="pd")
    w = _exact_weights(lin)
    # the layout read back by hand holds the weights the dense path multiplies by
    assert torch.allclose(w.float(), lin.dequantized().float(), rtol=2**-8, atol=1e-6)
    x = torch.randn(num_rows, k) * torch.logspace(-2, 1, k)  # groups of different magnitudes
    with torch.no_grad():
        out = lin(x)
    assert out.shape == (num_rows, n) and out.dtype == torch.float32
    exact = x.double() @ w.T
    # each input is within half a step of its group's 16-bit grid (largest |x| / 32767),
    # plus fp32 sums: a relative 2^-20 of the sum of |products|
    step = x.view(num_rows, k // 32, 32).abs().amax(-1, keepdim=True) / 32767
    grid = step.expand(num_rows, k // 32, 32).reshape(num_rows, k).double()
    bound = (grid / 2) @ w.abs().T + 2**-20 * (x.double().abs() @ w.abs().T) + 1e-7
    assert ((out.double() - exact).abs() <= bound).all()
    if num_rows:
        # the bound has teeth: the inputs in another order break it
        assert ((x.double().flip(1) @ w.T - exact).abs() > bound).any()


@needs_kernel
@pytest.mark.timeout(30)
def test_two_threads_give_the_products_of_one() -> None:
    lin = Int4Linear(_linear(136, 576), kernel="pd")  # above the weights one thread runs alone
    x = torch.randn(5, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin(x)
        torch.set_num_threads(2)
        two = lin(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each output row is computed by one thread, the same way


@needs_kernel
@pytest.mark.timeout(30)
def test_the_kernel_and_torchs_op_multiply_by_the_same_weights() -> None:
    linear = _linear(96, 4 * 32)
    ours, theirs = Int4Linear(linear, kernel="pd"), Int4Linear(linear, kernel="torch")
    assert torch.equal(ours.dequantized(), theirs.dequantized())
    eye = torch.eye(linear.in_features)
    with torch.no_grad():
        # the identity reads the weights back (torch's in bf16, its output rounding)
        assert torch.allclose(ours(eye), theirs(eye), rtol=2**-8, atol=1e-6)


@pytest.mark.timeout(30)
def test_without_a_compiler_the_op_is_unavailable_and_int4_runs_on_torchs(
    monkeypatch, tmp_path
) -> None:
    monkeypatch.setenv("PD_CACHE_DIR", str(tmp_path))  # nothing built there
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    assert cpp.load_torch_ops("int4_mm", int4_kernel._SOURCE) is None
    # a fresh look for the library (the process may have loaded it already)
    monkeypatch.setattr(int4_kernel, "_library", functools.cache(int4_kernel._library.__wrapped__))
    assert not int4_kernel.available() and not int4_kernel.preferred()
    assert Int4Linear(_linear(16, 64)).kernel == "torch"


@pytest.mark.timeout(30)
def test_the_kernel_choice_follows_the_cpu_and_pd_int4_kernel(monkeypatch) -> None:
    linear = _linear(16, 64)
    monkeypatch.setattr(int4_kernel, "preferred", lambda: False)
    assert Int4Linear(linear).kernel == "torch"  # auto: torch's op has its fast path here
    monkeypatch.setenv("PD_INT4_KERNEL", "torch")
    assert Int4Linear(linear).kernel == "torch"
    monkeypatch.setattr(int4_kernel, "available", lambda: False)
    monkeypatch.setenv("PD_INT4_KERNEL", "pd")
    with pytest.raises(ValueError, match="pd's int4 kernel does not run here"):
        Int4Linear(linear)
    monkeypatch.setenv("PD_INT4_KERNEL", "fast")
    with pytest.raises(ValueError, match="PD_INT4_KERNEL='fast' is not one of auto, pd, torch"):
        Int4Linear(linear)
    monkeypatch.setenv("PD_INT4_KERNEL", "auto")
    monkeypatch.setattr(int4_kernel, "available", lambda: True)
    monkeypatch.setattr(int4_kernel, "preferred", lambda: True)
    assert Int4Linear(linear).kernel == "pd"
    assert quant._pick_int4_kernel("auto", 12, 32) == "torch"  # 12 outputs: not blocks of 8 rows


@needs_kernel
@pytest.mark.timeout(30)
def test_the_kernel_refuses_inputs_off_its_weights() -> None:
    lin = Int4Linear(_linear(16, 64), kernel="pd")
    with pytest.raises(ValueError, match="x has 96 inputs, the weight 64"):
        torch.ops.pd.int4_mm(torch.randn(2, 96), lin.qweight, lin.scales, lin.zeros)
    with pytest.raises(ValueError, match="needs out_features % 8 == 0 .* got 12 x 64"):
        int4_kernel.pack(torch.zeros(12, 64), torch.ones(12, 2), torch.zeros(12, 2))


@needs_kernel
@pytest.mark.timeout(60)
def test_a_compiled_graph_calls_the_kernel_as_one_op() -> None:
    lin = Int4Linear(_linear(32, 64), kernel="pd")
    x = torch.randn(3, 64)
    with torch.no_grad():
        eager = lin(x)
        compiled = torch.compile(lin, fullgraph=True)(x)
    assert torch.equal(compiled, eager)
    assert quant.DEQUANT_MIN_TOKENS > 3  # the kernel's path, not the dense one


_OTHER_BUILD = """
import sys, torch
from torch import nn
from pd.model.quant import Int4Linear
out = []
for k, n in ((576, 1536), (1536, 576), (576, 968)):  # 968: an odd block of 8 rows at the end
    torch.manual_seed(k + n)
    layer = Int4Linear(nn.Linear(k, n, bias=False), kernel="pd", dense_min_tokens=None)
    out.append(layer(torch.randn(37, k)))
torch.save(out, sys.argv[1])
"""


@needs_kernel
@pytest.mark.slow
def test_an_avx2_build_gives_the_bits_of_this_machines_build(tmp_path) -> None:
    """With AVX-512 VNNI the kernel takes 16 rows a vector (with AMX, 16 rows of x a tile); its
    outputs are the AVX2 path's, bit for bit, so nodes on either CPU compute the same int4
    products (37 rows: AMX's tiles where the CPU has them)."""
    import os
    import subprocess
    import sys

    if " avx512_vnni " not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX-512 VNNI: its build is the AVX2 one")
    outs = []
    for level in ("native", "avx2"):
        out = tmp_path / f"{level}.pt"
        env = {**os.environ, "PD_CPU_ISA": level}
        subprocess.run(
            [sys.executable, "-c", _OTHER_BUILD, str(out)], env=env, check=True, timeout=300
        )
        outs.append(torch.load(out))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
