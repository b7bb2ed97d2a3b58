"""CPU linears packed once at load and swapped in for a model's ``nn.Linear``s.

Deterministic (``quantize_linears(..., deterministic=True)``, the engine's default): every
linear runs on one of pd's own kernels, whose every output is one fixed chain of operations
over the inputs in their order, so a row's bits never depend on the other rows, their number
or the thread count (a property of the code, checked by tests/model/test_deterministic.py at
every ISA level the CPU can be capped to):

    method  weight                                   matmul op           the same bits
    none    fp32 or bf16, as the model's dtype       pd::fixed_mm        on every x86 CPU
    int8    int8 [N, K], a scale per output row      pd::fixed_mm        on every x86 CPU
    int4    uint4 packed, a scale and a zero per     pd::int4_mm         on every x86 CPU
            row and group of 32 inputs                                   with AVX2 and FMA
    fp16    fp16                                     pd::fixed_mm        on every x86 CPU
    head    fp16 in every quantized method           pd::fixed_mm

``pd.model.gemm`` (fp32 fma chains over converted weights) and ``pd.model.int4_kernel`` (exact
int32 sums of 16-bit inputs, then fixed fp32 steps) say how.

Without it (``--no-deterministic``) the fastest library op runs each format: unquantized
weights go to oneDNN where torch has it (``LINEAR_BACKENDS``, the weight reordered once into
oneDNN's blocked layout; BENCHMARKS.md, "CPU weight formats"), int8 to
``aten._weight_int8pack_mm`` (bf16 inputs: its fp32 path is scalar), fp16 to fbgemm's packed
layout, and from ``DEQUANT_MIN_TOKENS`` rows on (prefill) a quantized weight is multiplied as
a dense GEMM: int4 keeps a copy dequantized once at load (in bf16 where oneDNN has its bf16
path, AMX on an Intel Xeon; in fp32 on an AVX2-only CPU: ``dense_dtype``), int8 dequantizes on
each call. A prompt's KV then depends on how it was chunked and batched (BENCHMARKS.md,
"Deterministic inference"). ``PD_INT4_KERNEL=torch`` runs torch's int4 op instead of pd's
(not deterministic). Speed and quality of each format: ``scripts/bench_quant.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pd.core import envs
from pd.model import gemm, int4_kernel

QUANTIZATION_METHODS = ("none", "int8", "int4", "fp16")
LINEAR_BACKENDS = ("auto", "onednn", "aten")  # for unquantized weights on cpu
INT4_GROUP_SIZE = 32
INT4_KERNELS = ("pd", "torch")  # pd.model.int4_kernel, aten._weight_int4pack_mm_for_cpu
# From this many tokens on (prefill), a dense GEMM replaces the int8 and int4 kernels, unless
# deterministic (the module's docstring).
DEQUANT_MIN_TOKENS = 128
# a mixture of experts' router (``pd.model.decoder.MoE.gate``): kept unquantized, its choices
# are the experts'
ROUTER_NAME = "gate"


class QuantLinear(nn.Module):
    """A packed linear in place of an ``nn.Linear`` whose inputs are ``[T, in_features]``."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> [T, out_features], both in the model's dtype
        y = self._matmul(x).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int8Linear(QuantLinear):
    """Symmetric per-output-channel int8: ``W ≈ q * scale[:, None]``, max |w| of a row → 127.
    ``dense_min_tokens``: from this many rows on, a dense GEMM, below it torch's int8 op (None:
    pd's fixed matmul at every row count, deterministic)."""

    def __init__(
        self, linear: nn.Linear, dense_min_tokens: int | None = DEQUANT_MIN_TOKENS
    ) -> None:
        super().__init__(linear)
        w = linear.weight.detach().float()
        scale = w.abs().amax(1).clamp(min=1e-12) / 127
        qweight = torch.round(w / scale[:, None]).to(torch.int8)
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.dense_min_tokens = dense_min_tokens
        if dense_min_tokens is None:
            self.register_buffer("qweight", gemm.pack(qweight))
            self.register_buffer("packed_scale", gemm.pack_scale(self.scale))
        else:
            self.register_buffer("qweight", qweight)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense_min_tokens is None:
            n = self.out_features
            return torch.ops.pd.fixed_mm(x, self.qweight, self.packed_scale, n)
        if x.shape[0] >= self.dense_min_tokens:
            weight = self.qweight.to(x.dtype) * self.scale.to(x.dtype)[:, None]
            return F.linear(x, weight)
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scale)


class Int4Linear(QuantLinear):
    """Asymmetric int4 per row and group of ``INT4_GROUP_SIZE`` inputs: a group's min..max maps
    to 0..15 and the op dequantizes ``(q - 8) * scale + zero`` with ``zero = min + 8 * scale``.
    ``dense_min_tokens``: from this many rows on, the dense copy (None: never, and no copy is
    kept: the kernel alone, whose rows do not depend on each other)."""

    def __init__(
        self,
        linear: nn.Linear,
        group_size: int = INT4_GROUP_SIZE,
        kernel: str | None = None,
        dense_min_tokens: int | None = DEQUANT_MIN_TOKENS,
    ) -> None:
        super().__init__(linear)
        n, k = self.out_features, self.in_features
        if k % group_size:
            raise ValueError(f"int4 needs in_features divisible by {group_size}, got {k}")
        self.group_size = group_size
        self.kernel = _pick_int4_kernel(kernel or envs.PD_INT4_KERNEL, n, group_size)
        w = linear.weight.detach().float().view(n, k // group_size, group_size)
        lo, hi = w.amin(-1), w.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-12)  # [N, groups]
        q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        # the kernels dequantize ``(q - 8) * scale + zero`` with a bf16 scale and zero
        scale, zero = scale.to(torch.bfloat16), (lo + 8 * scale).to(torch.bfloat16)
        if self.kernel == "pd":
            packed, scales, zeros = int4_kernel.pack(q.view(n, k), scale, zero)
            self.register_buffer("qweight", packed)
            self.register_buffer("scales", scales)
            self.register_buffer("zeros", zeros)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(n, k), 1)
            self.register_buffer("qweight", packed)
            # the op wants [groups, N, 2] of (scale, zero)
            self.register_buffer(
                "scales_zeros", torch.stack((scale, zero), -1).transpose(0, 1).contiguous()
            )
        # the weight the kernels multiply by, rounded once to bf16, for the dense path (in
        # fp32 where bf16 GEMMs are slow: the same values, see dense_dtype)
        self.dense_min_tokens = dense_min_tokens
        dense = None
        if dense_min_tokens is not None:
            dense = (q.float() - 8) * scale.float()[..., None] + zero.float()[..., None]
            dense = dense.view(n, k).to(torch.bfloat16).to(dense_dtype())
        self.register_buffer("dense", dense)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] >= self.dense_min_tokens:
            return F.linear(x.to(self.dense.dtype), self.dense)
        if self.kernel == "pd":
            return torch.ops.pd.int4_mm(x, self.qweight, self.scales, self.zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.qweight, self.group_size, self.scales_zeros
        )

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel multiplies by, rounded once to bf16: [N, K] (kept only with a
        dense path)."""
        assert self.dense is not None, "built without a dense path (dense_min_tokens=None)"
        return self.dense


def _pick_int4_kernel(choice: str, out_features: int, group_size: int) -> str:
    """The int4 matmul of few rows, ``pd`` or ``torch``, for ``choice`` (``auto``: pd's kernel
    where it runs and torch's runs without AVX-512, see ``int4_kernel.preferred``)."""
    fits = out_features % int4_kernel.ROWS_PER_BLOCK == 0 and group_size == int4_kernel.GROUP_SIZE
    if choice == "auto":
        return "pd" if fits and int4_kernel.preferred() else "torch"
    if choice == "pd" and not (fits and int4_kernel.available()):
        raise ValueError(
            f"pd's int4 kernel does not run here ({out_features} outputs, groups of "
            f"{group_size}; it needs a multiple of {int4_kernel.ROWS_PER_BLOCK}, groups of "
            f"{int4_kernel.GROUP_SIZE}, a C++ compiler and AVX2 with FMA)"
        )
    if choice not in INT4_KERNELS:
        raise ValueError(f"int4 kernel must be auto or one of {INT4_KERNELS}, got {choice!r}")
    return choice


class Fp16Linear(QuantLinear):
    """fp16 weights in fbgemm's packed layout; fp32 inputs, fp32 accumulation."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        weight = linear.weight.detach().float().contiguous()
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight, None)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x.float(), self.packed)


class OneDNNLinear(QuantLinear):
    """Unquantized weights (fp32 or bf16) in oneDNN's packed layout; inputs in the same dtype.
    Not deterministic: oneDNN picks its kernel and its order of sums by the row count."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        weight = linear.weight.detach().contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> [T, out_features]; the bias is added inside the op
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class FixedLinear(QuantLinear):
    """Weights in fp32, bf16 or fp16 (``dtype``, default the weight's) multiplied by pd's fixed
    matmul (``pd.model.gemm``): a row's bits whatever the other rows, on every x86 CPU. The
    output is rounded once to the input's dtype."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype | None = None) -> None:
        super().__init__(linear)
        self.register_buffer("packed", gemm.pack(linear.weight.detach(), dtype))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.pd.fixed_mm(x, self.packed, None, self.out_features)


_LINEARS: dict[str, type[QuantLinear]] = {
    "int8": Int8Linear,
    "int4": Int4Linear,
    "fp16": Fp16Linear,
}


def check_quantization(method: str, device: torch.device) -> None:
    """Raise if ``method`` is unknown or cannot run on ``device`` (all methods are CPU-only)."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {method!r}"
        )
    if method != "none" and device.type != "cpu":
        raise ValueError(f"quantization {method!r} runs on cpu only, got device {device}")
    if method == "int4" and not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        raise ValueError(f"quantization 'int4' needs torch >= 2.6, have {torch.__version__}")
    if method == "fp16" and not _has_fbgemm():
        engines = torch.backends.quantized.supported_engines
        raise ValueError(f"quantization 'fp16' needs torch's fbgemm engine; have {engines}")


def resolve_linear_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """``onednn`` or ``aten`` for unquantized weights; ``auto`` is oneDNN on a cpu that torch
    built it for, with fp32 weights, or bf16 ones where the cpu has oneDNN's bf16 path
    (AVX512BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only cpu has neither, and aten's GEMM runs bf16
    there). Raise if ``backend`` is unknown or cannot run."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(
            f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}, got {backend!r}"
        )
    mkldnn = torch.backends.mkldnn.is_available()
    usable = (
        device.type == "cpu"
        and mkldnn
        and (dtype == torch.float32 or (dtype == torch.bfloat16 and onednn_has_bf16()))
    )
    if backend == "onednn" and not usable:
        raise ValueError(
            f"linear_backend 'onednn' needs a cpu, float32 (or bfloat16 on a cpu with oneDNN's "
            f"bf16 path: AVX512BW/VL/DQ or AVX-NE-CONVERT) and torch built with mkldnn; have "
            f"device {device}, {dtype}, mkldnn={mkldnn}, bf16 path={onednn_has_bf16()}"
        )
    if backend == "auto":
        return "onednn" if usable else "aten"
    return backend


def onednn_has_bf16() -> bool:
    """Whether this cpu runs oneDNN's bf16 kernels (torch asks oneDNN)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def dense_dtype() -> torch.dtype:
    """The dtype of int4's dequantized prefill copy, and of long quantized prefill chunks'
    attention (``--no-deterministic``): bf16 where oneDNN has its bf16 path, else fp32 (there
    bf16 GEMMs are far slower: BENCHMARKS.md, "CPU weight formats")."""
    return torch.bfloat16 if onednn_has_bf16() else torch.float32


def _has_fbgemm() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def quantize_linears(
    model: nn.Module,
    method: str,
    head_name: str = "lm_head",
    linear_backend: str = "aten",
    deterministic: bool = False,
) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by ``method``'s packed module.

    ``deterministic``: every linear on pd's own kernels (the module's docstring; raise where
    they cannot run: ``check_deterministic``), ``linear_backend`` unused. Otherwise ``none``
    packs nothing with ``linear_backend="aten"`` and every linear (the head too) as a
    ``OneDNNLinear`` with ``"onednn"`` (a resolved backend: see ``resolve_linear_backend``).

    With a quantized method a mixture of experts' router (``ROUTER_NAME``) keeps the model's
    precision (its choices are the experts'), and the LM head (children named ``head_name``)
    is packed as fp16: for SmolLM2's 49152x576 head as fast as int4, faster than int8 and far
    closer to the weights (the GGUF stores it as Q8_0, finer than int4 or per-row int8). A
    head tied to the embedding is packed from the shared weight into a separate copy; the
    embedding itself stays exact.
    """
    if deterministic:
        check_deterministic(method)
        return _replace_linears(model, _fixed_maker(method, head_name))
    if method == "none" and linear_backend == "aten":
        return model
    if method == "none":
        return _replace_linears(model, lambda name, lin: OneDNNLinear(lin))

    def router(lin: nn.Linear) -> QuantLinear | nn.Linear:  # kept at the model's precision
        return OneDNNLinear(lin) if linear_backend == "onednn" else lin

    make: Callable[[nn.Linear], QuantLinear] = (
        Int4Linear if method == "int4" else Int8Linear if method == "int8" else _LINEARS[method]
    )
    head = Fp16Linear if _has_fbgemm() else make
    by_name = {head_name: head, ROUTER_NAME: router}
    return _replace_linears(model, lambda name, lin: by_name.get(name, make)(lin))


def _fixed_maker(method: str, head_name: str) -> Callable[[str, nn.Linear], QuantLinear]:
    """name, linear -> its deterministic module for ``method``."""

    def make(name: str, lin: nn.Linear) -> QuantLinear:
        if method == "none" or name == ROUTER_NAME:
            return FixedLinear(lin)
        if method == "fp16" or name == head_name:
            return FixedLinear(lin, torch.float16)
        if method == "int8":
            return Int8Linear(lin, dense_min_tokens=None)
        return Int4Linear(lin, kernel="pd", dense_min_tokens=None)

    return make


def check_deterministic(method: str) -> None:
    """Raise (saying what to change) where ``quantize_linears(..., deterministic=True)`` cannot
    run here: pd's kernels need a C++ compiler, int4's AVX2 with FMA and pd's int4 kernel."""
    if not gemm.available():
        raise ValueError(
            "deterministic inference runs pd's own matmul, which did not build here (no C++ "
            "compiler? see the log); pass --no-deterministic"
        )
    if method == "int4" and not int4_kernel.available():
        raise ValueError(
            "deterministic int4 runs pd's int4 kernel, which needs a C++ compiler and AVX2 "
            "with FMA; use another --quantization or pass --no-deterministic"
        )
    if method == "int4" and envs.PD_INT4_KERNEL == "torch":
        raise ValueError(
            "PD_INT4_KERNEL=torch is not deterministic (torch's op picks its own order of "
            "sums): unset it or pass --no-deterministic"
        )


def _replace_linears(model: nn.Module, make: Callable[[str, nn.Linear], QuantLinear]) -> nn.Module:
    """Swap each ``nn.Linear`` child for ``make(its name, it)``, in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(name, child))
    return model
