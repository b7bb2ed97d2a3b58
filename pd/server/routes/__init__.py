"""The endpoints, by family: OpenAI (completions, chat), native (/generate), ops; and admin
(``/admin/*``), which ``build_app`` includes when it is given a cluster to operate."""

from __future__ import annotations

from pd.server.routes import completions, native, ops

ROUTERS = (completions.router, native.router, ops.router)

__all__ = ["ROUTERS"]
