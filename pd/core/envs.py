"""Every environment variable pd reads, in one place.

Values are read when accessed (``pd.core.envs.PD_CACHE_DIR``), not at import, so tests can
monkeypatch the environment. Add a variable by adding one entry to ``_READERS`` and one
annotation under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    PD_CACHE_DIR: Path
    PD_DEBUG: bool
    PD_NUM_THREADS: int | None
    PD_API_KEY: tuple[str, ...]
    PD_ADMIN_API_KEY: tuple[str, ...]
    PD_INT4_KERNEL: str
    PD_CPU_ISA: str

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def _read_bool(name: str) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(
        f"{name}={raw!r} is not a boolean (use one of 1/0, true/false, yes/no, on/off)"
    )


def _read_optional_int(name: str, min_value: int) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < min_value:
        raise ValueError(f"{name}={value} must be >= {min_value}")
    return value


def _read_csv(name: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in os.environ.get(name, "").split(",") if part.strip())


def _read_choice(name: str, choices: tuple[str, ...]) -> str:
    raw = os.environ.get(name, "").strip().lower() or choices[0]
    if raw not in choices:
        raise ValueError(f"{name}={raw!r} is not one of {', '.join(choices)}")
    return raw


def _read_cache_dir() -> Path:
    raw = os.environ.get("PD_CACHE_DIR", "").strip()
    return Path(raw or "~/.cache/pd").expanduser()


_READERS: dict[str, Callable[[], Any]] = {
    # Root of pd's local caches; converted models live in PD_CACHE_DIR/models/.
    "PD_CACHE_DIR": _read_cache_dir,
    # Extra integrity checks (e.g. check_integrity() when idle).
    "PD_DEBUG": lambda: _read_bool("PD_DEBUG"),
    # torch intra-op threads per process; None leaves torch's default.
    "PD_NUM_THREADS": lambda: _read_optional_int("PD_NUM_THREADS", min_value=1),
    # API keys of `pd serve`, comma-separated (added to its --api-key flags); empty: open.
    "PD_API_KEY": lambda: _read_csv("PD_API_KEY"),
    # admin API keys of `pd serve` (added to --admin-api-key); `pd scale` / `pd status` send one
    "PD_ADMIN_API_KEY": lambda: _read_csv("PD_ADMIN_API_KEY"),
    # the int4 matmul of few rows: auto (pd's kernel where torch's lacks AVX-512), pd or torch
    "PD_INT4_KERNEL": lambda: _read_choice("PD_INT4_KERNEL", ("auto", "pd", "torch")),
    # the instruction set pd's C++ kernels are built for (pd.core.cpp.ISA_LEVELS): native, or
    # capped to avx512 (no AMX), avx2 or generic, so one machine runs each level's code
    "PD_CPU_ISA": lambda: _read_choice("PD_CPU_ISA", ("native", "avx512", "avx2", "generic")),
}


def __getattr__(name: str) -> Any:
    reader = _READERS.get(name)
    if reader is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return reader()


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_READERS))
