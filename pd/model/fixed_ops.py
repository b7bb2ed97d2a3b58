"""The model's elementwise and norm steps as opaque torch operators, for deterministic runs.

A compiled decode step (``pd.executor.graphs``) hands the RMSNorm, the rotary embedding and the
gated SiLU to inductor, which fuses them into loops of its own: other code, other rounding
(a multiply and an add contracted into one fma, another order of the norm's sum) than the
eager ops that prefill the same tokens. The KV of a token then depends on whether a compiled
step or an eager forward computed it, and so does every answer that reads it. Called through
these operators, the steps are calls the graph cannot look into, the same code in a graph and
out of one, and each row's result depends on that row alone. Each is one loop in C++ (torch's
own rms_norm is a dozen ops on the CPU, 40 us a call in a decode step), every rounding spelled
out: the same bits on any x86 CPU.

``torch.ops.pd.rms_norm(x, weight, eps)``: RMSNorm over the last dim (the squares summed in a
fixed order); ``torch.ops.pd.rotary(x, cos, sin)``: ``fma(x, cos, roll(x, half) * sin)`` (the
neox rotation with ``Rotary``'s signed sin); ``torch.ops.pd.silu_mul(gate_up)``: ``silu(gate)
* up`` of the two halves of the last dim (torch's silu), and ``torch.ops.pd.gelu_tanh_mul`` the
same with torch's tanh-GELU (Gemma's GeGLU). Built by ``pd.core.cpp.load_torch_ops`` (``available`` is False where
it cannot be; the model then calls torch's ops directly).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from pd.core import cpp

_SOURCE = Path(__file__).with_suffix(".cpp").read_text()  # the C++ beside this module


def _fake_same(x: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(x)


def _fake_half(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@functools.cache
def available() -> bool:
    """Whether the operators are built and registered (logged once where they cannot be)."""
    fakes = {
        "pd::rms_norm": _fake_same,
        "pd::rotary": _fake_same,
        "pd::silu_mul": _fake_half,
        "pd::gelu_tanh_mul": _fake_half,
    }
    return cpp.load_torch_ops("fixed_ops", _SOURCE, fakes) is not None
