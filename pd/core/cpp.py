"""pd's C++ kernels: torch operators built on first use with the machine's compiler.

Each kernel is one C++ file beside the Python module that loads it (``cpu_attention.cpp`` beside
``pd.executor.cpu_attention``; ``int4_kernel.cpp``, ``gemm.cpp``, ``fixed_ops.cpp`` in ``pd.model``), which
registers torch operators from C++ (``TORCH_LIBRARY_FRAGMENT``).
``load_torch_ops`` compiles it once against the running torch's headers (seconds) into
``PD_CACHE_DIR/kernels``, under a name keyed by the source, the compiler, the flags, torch's
version and the CPU's flags, so a changed source or another machine builds again and concurrent
builders leave the same file, and loads it into torch's dispatcher. A ``.so`` that another user
can write is code execution in this process, so ``kernels`` is made 0700, and ``PD_CACHE_DIR``,
``kernels`` and the library must be this user's (or root's) and writable by neither group nor
others, else ``InsecurePathError`` names the path and its mode (``pd.core.private_dir``). A compiled graph calls such
an operator through the dispatcher alone (the same kernels as Python operators calling ctypes
cost tens of microseconds more a call, a third of an int4 decode step).
Plain C functions of the same library (what a kernel supports) are read with ctypes.

Where there is no compiler or the build fails, ``load_torch_ops`` logs why and returns None,
and the caller runs torch's ops instead (an insecure cache directory is raised, not logged).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch.utils import cpp_extension

from pd.core import envs
from pd.core.private_dir import InsecurePathError, check_trusted, private_dir

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")
# What each ``PD_CPU_ISA`` level builds for, and the CPU flags it needs: the machine's own
# instructions, or capped (so one machine runs and tests the code of a smaller CPU). Each
# kernel says what each level means for its bits (``pd.model.gemm``, ``pd.model.int4_kernel``).
ISA_LEVELS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "native": (("-march=native", "-mprefer-vector-width=512"), ()),
    "avx512": (
        ("-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16",
         "-mprefer-vector-width=512"),
        ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    ),
    "avx2": (("-march=x86-64-v3",), ("avx2", "fma", "f16c", "bmi2")),
    "generic": ((), ()),  # the compiler's default target: no vectors past SSE2 on x86-64
}  # fmt: skip


# ops whose fake (their output for tracing) is registered: once a process, however often a
# library is looked for again
_FAKES: set[str] = set()


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def cpu_signature() -> str:
    """The CPU's flags and the ``PD_CPU_ISA`` level: what code built here may assume."""
    return f"{envs.PD_CPU_ISA} {_cpu_flags().strip()}"


def isa_flags(level: str | None = None) -> tuple[str, ...]:
    """The compiler flags of ``level`` (default ``PD_CPU_ISA``); ValueError where this CPU
    lacks what the level needs."""
    level = level or envs.PD_CPU_ISA
    flags, needs = ISA_LEVELS[level]
    have = set(_cpu_flags().split())
    missing = [flag for flag in needs if flag not in have]
    if missing:
        raise ValueError(f"PD_CPU_ISA={level} needs CPU flags this CPU lacks: {missing}")
    return flags


def available_isa_levels() -> list[str]:
    """The ``PD_CPU_ISA`` levels this CPU runs, from the machine's own down."""
    have = set(_cpu_flags().split())
    return [level for level, (_, needs) in ISA_LEVELS.items() if set(needs) <= have]


def _kernels_dir() -> Path:
    """``PD_CACHE_DIR/kernels``, made 0700; both checked (``InsecurePathError``)."""
    root = envs.PD_CACHE_DIR
    if not os.path.lexists(root):
        root.mkdir(parents=True, mode=0o755, exist_ok=True)  # models/ in it may be shared
    check_trusted(root, os.lstat(root), is_dir=True)  # else kernels/ could be swapped
    return private_dir(root / "kernels")


def load_torch_ops(
    name: str, source: str, fakes: Mapping[str, Callable[..., torch.Tensor]] | None = None
) -> ctypes.CDLL | None:
    """Build ``source``, which registers torch operators (``TORCH_LIBRARY_FRAGMENT``), against
    the running torch, load it into torch's dispatcher and register ``fakes`` (op name -> its
    output for tracing); -> the library, for its plain C functions, or None where it cannot be
    built or loaded."""
    flags = [
        *FLAGS,
        *isa_flags(),
        "-std=c++20",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
    ]
    libs = [
        *(f"-L{p}" for p in cpp_extension.library_paths()),
        *(f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()),
        "-lc10",
        "-ltorch_cpu",
    ]
    path = _build(name, source, flags, libs, also=torch.__version__)  # a new torch: new build
    if path is None:
        return None
    try:
        torch.ops.load_library(str(path))
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as e:
        logger.warning("loading %s failed (%s): torch's ops instead", name, e)
        return None
    for op, fake in (fakes or {}).items():
        if op not in _FAKES:
            torch.library.register_fake(op)(fake)
            _FAKES.add(op)
    return lib


def _build(
    name: str, source: str, flags: Sequence[str], libs: Sequence[str] = (), also: str = ""
) -> Path | None:
    """The path of the library built from ``source`` (built now unless cached; ``libs``: what
    it links, after the source; ``also``: more that its cache key depends on), or None."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        logger.info("no C++ compiler: %s runs on torch's ops", name)
        return None
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
        parts = (source, compiler, version, " ".join([*flags, *libs]), _cpu_flags(), also)
        key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
        out_dir = _kernels_dir()
        path = out_dir / f"{name}-{key}.so"
        if not path.exists():
            with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
                src = Path(tmp) / f"{name}.cpp"
                src.write_text(source)
                built = Path(tmp) / path.name
                subprocess.run(
                    [compiler, *flags, str(src), *libs, "-o", str(built)],
                    check=True,
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                os.replace(built, path)  # atomic: a concurrent builder leaves the same file
        check_trusted(path, os.lstat(path), is_dir=False)  # what is loaded is this user's
        return path
    except InsecurePathError:
        raise  # not a build that failed: an operator's error, which running slower would hide
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        logger.warning("building %s failed (%s): torch's ops instead", name, detail)
        return None
