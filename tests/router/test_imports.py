"""The router is plain Python: importing any of its modules imports no socket library (zmq) and
no Ray. Checked in a fresh interpreter, where no other test's imports are loaded already."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pd.router

ROOT = Path(__file__).resolve().parent.parent.parent
FORBIDDEN = ("zmq", "ray")


def test_importing_every_router_module_imports_no_zmq_and_no_ray() -> None:
    modules = ["pd.router"] + [
        f"pd.router.{m.name}" for m in pkgutil.iter_modules(pd.router.__path__)
    ]
    assert "pd.router.coordinator" in modules, modules
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", f"pd.router imported {out.stdout.strip()}"
