"""ASGI middleware of the server, outermost first:

- ``CatchAllMiddleware``: anything unexpected is a 500 in OpenAI's shape, never plain text;
- ``AuthMiddleware``: ``Authorization: Bearer <key>`` on every path but the open ones (401),
  an admin key on the admin paths (403 for a tenant key);
- ``KeyLimitMiddleware`` (``pd.server.key_limits``): each key's requests in flight and tokens
  per minute (429);
- ``BodyLimitMiddleware``: a body larger than the cap is 413, on its Content-Length before
  anything is read, or as soon as the bytes read (of a chunked body) pass the cap.
"""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pd.server.auth import API_KEY_SCOPE, ROLE_SCOPE, ApiKeys, Role
from pd.server.errors import APIError, internal_error
from pd.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


class CatchAllMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracking(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except Exception as e:
            err = e if isinstance(e, APIError) else internal_error(e)
            if err.status_code >= 500:
                logger.exception("%s %s failed", scope.get("method"), scope.get("path"))
            if not started:  # else the connection just ends: a body cannot take a status
                await err.response()(scope, receive, send)


def is_admin_path(path: str) -> bool:
    """Paths only an admin key may use: the admin API and /metrics (per-node labels)."""
    return path == "/metrics" or path == "/admin" or path.startswith("/admin/")


class AuthMiddleware:
    """Puts the key a request carried and its role in the ASGI scope (``API_KEY_SCOPE``,
    ``ROLE_SCOPE``). Open paths pass without a key (one that matches still counts: an admin
    sees the node list on /ready); others need a key (401), admin paths an admin key (403)."""

    def __init__(
        self, app: ASGIApp, keys: ApiKeys, open_paths: frozenset[str], metrics: ServerMetrics
    ) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = open_paths
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self.keys.is_enabled:
            scope[ROLE_SCOPE] = Role.ADMIN  # an open API: its admin routes are open too
            await self.app(scope, receive, send)
            return
        found = self.keys.match(_header(scope, b"authorization"))
        path = scope["path"]
        if found is not None:
            scope[API_KEY_SCOPE], scope[ROLE_SCOPE] = found.key, found.role
        if path in self.open_paths:
            await self.app(scope, receive, send)
            return
        if found is None:
            self.metrics.rejected.labels(reason="unauthorized").inc()
            err = APIError(
                "missing or invalid API key: send `Authorization: Bearer <key>`",
                status_code=401,
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await err.response()(scope, receive, send)
            return
        if found.role is not Role.ADMIN and is_admin_path(path):
            self.metrics.rejected.labels(reason="forbidden").inc()
            await self._forbidden(path).response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _forbidden(self, path: str) -> APIError:
        if self.keys.has_admin_keys:
            why = f"{path} needs an admin API key; this key is a tenant's"
        else:
            why = (
                f"{path} needs an admin API key, and this server has none "
                "(start it with --admin-api-key or PD_ADMIN_API_KEY)"
            )
        return APIError(why, status_code=403, type="permission_error", code="admin_key_required")


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, metrics: ServerMetrics) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.metrics = metrics

    def _too_large(self, num_bytes: str) -> APIError:
        self.metrics.rejected.labels(reason="body_too_large").inc()
        return APIError(
            f"request body of {num_bytes} bytes, at most {self.max_bytes}",
            status_code=413,
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        declared = length is not None and length.isdigit()
        if declared and (len(length) > 18 or int(length) > self.max_bytes):
            await self._too_large(length.decode()).response()(scope, receive, send)
            return
        num_read = 0

        async def receive_capped() -> Message:
            nonlocal num_read
            message = await receive()
            if message["type"] == "http.request":
                num_read += len(message.get("body", b""))
                if num_read > self.max_bytes:
                    raise self._too_large(f"more than {self.max_bytes}")
            return message

        await self.app(scope, receive_capped, send)
