"""The OpenAI-compatible HTTP server: ``build_app(client, ...)`` over any ``EngineClient``."""

from __future__ import annotations

from pd.server.app import build_app
from pd.server.metrics import ServerMetrics

__all__ = ["ServerMetrics", "build_app"]
