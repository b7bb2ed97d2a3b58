"""The OpenAI-compatible HTTP server (layer 12, above the fleet): ``build_app(client, ...)`` over any ``EngineClient``.

Exports load on first use, so ``pd.server.config`` (read by the CLI of every command) does not
pull FastAPI in.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pd.server.app import build_app
    from pd.server.config import ServerConfig
    from pd.server.metrics import ServerMetrics

__all__ = ["ServerConfig", "ServerMetrics", "build_app"]

_HOMES = {"build_app": "pd.server.app", "ServerConfig": "pd.server.config",
          "ServerMetrics": "pd.server.metrics"}  # fmt: skip


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
