"""The endpoints, by family: OpenAI (completions, chat), native (/generate), ops."""

from __future__ import annotations

from pd.server.routes import completions, native, ops

ROUTERS = (completions.router, native.router, ops.router)

__all__ = ["ROUTERS"]
