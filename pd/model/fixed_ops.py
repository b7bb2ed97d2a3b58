"""The model's elementwise and norm steps as opaque torch operators, for deterministic runs.

A compiled decode step (``pd.engine.graphs``) hands the RMSNorm, the rotary embedding and the
gated SiLU to inductor, which fuses them into loops of its own: other code, other rounding
(a multiply and an add contracted into one fma, another order of the norm's sum) than the
eager ops that prefill the same tokens. The KV of a token then depends on whether a compiled
step or an eager forward computed it, and so does every answer that reads it. Called through
these operators, the steps are calls the graph cannot look into: torch's own CPU kernels, the
same in a graph and out of one, and each row's result depends on that row alone.

``torch.ops.pd.rms_norm(x, weight, eps)``: ``F.rms_norm`` over the last dim;
``torch.ops.pd.rotary(x, cos, sin)``: ``x * cos + roll(x, half) * sin`` (the neox rotation with
``Rotary``'s signed sin); ``torch.ops.pd.silu_mul(gate_up)``: ``silu(gate) * up`` of the two
halves of the last dim. Built by ``pd.core.cpp.load_torch_ops`` (``available`` is False where
it cannot be; the model then calls torch's ops directly).
"""

from __future__ import annotations

import functools

import torch

from pd.core import cpp

_SOURCE = r"""
#include <ATen/ATen.h>
#include <torch/library.h>

static at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return at::rms_norm(x, {x.size(-1)}, weight, eps);
}

static at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return x * cos + x.roll({x.size(-1) / 2}, {-1}) * sin;
}

static at::Tensor silu_mul(const at::Tensor& gate_up) {
  const auto halves = gate_up.chunk(2, -1);
  return at::silu(halves[0]) * halves[1];
}

TORCH_LIBRARY_FRAGMENT(pd, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}
TORCH_LIBRARY_IMPL(pd, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_mul", &silu_mul);
}

extern "C" int pd_fixed_ops_loaded() { return 1; }
"""


def _fake_same(x: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(x)


def _fake_half(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@functools.cache
def available() -> bool:
    """Whether the operators are built and registered (logged once where they cannot be)."""
    fakes = {"pd::rms_norm": _fake_same, "pd::rotary": _fake_same, "pd::silu_mul": _fake_half}
    return cpp.load_torch_ops("fixed_ops", _SOURCE, fakes) is not None
