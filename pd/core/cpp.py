"""pd's C++ kernels, built on first use with the machine's compiler and loaded with ctypes.

Each kernel (``pd.engine.cpu_attention``, ``pd.model.int4_kernel``) is one C++ source in its
module. ``load`` compiles it once (~3 s) into ``PD_CACHE_DIR/kernels``, under a name keyed by
the source, the compiler, the flags and the CPU's flags, so a changed source or another machine
builds again and concurrent builders leave the same file. Where there is no compiler or the
build fails, ``load`` logs why and returns None, and the caller runs torch's ops instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pd.core import envs

logger = logging.getLogger(__name__)

FLAGS = (
    "-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fopenmp", "-shared",
    "-fPIC",
)  # fmt: skip


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def load(name: str, source: str, flags: Sequence[str] = FLAGS) -> ctypes.CDLL | None:
    """The library built from ``source`` (``name`` names its file and the log lines), or None
    where it cannot be built on this machine."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        logger.info("no C++ compiler: %s runs on torch's ops", name)
        return None
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
        key = hashlib.sha256(
            "\0".join((source, compiler, version, " ".join(flags), _cpu_flags())).encode()
        ).hexdigest()[:16]
        out_dir = envs.PD_CACHE_DIR / "kernels"
        path = out_dir / f"{name}-{key}.so"
        if not path.exists():
            out_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
                src = Path(tmp) / f"{name}.cpp"
                src.write_text(source)
                built = Path(tmp) / path.name
                subprocess.run(
                    [compiler, *flags, str(src), "-o", str(built)],
                    check=True,
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                os.replace(built, path)  # atomic: a concurrent builder leaves the same file
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        logger.warning("building %s failed (%s): torch's ops instead", name, detail)
        return None
