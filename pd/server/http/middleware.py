"""ASGI middleware of the server, outermost first:

- ``WriteTimeoutMiddleware`` (outside Starlette's own): every ``send`` bounded in time; a
  client that takes nothing for the write timeout is cut off;
- ``CatchAllMiddleware``: anything unexpected is a 500 in OpenAI's shape, never plain text;
- ``AuthMiddleware``: ``Authorization: Bearer <key>`` on every path but the open ones (401),
  an admin key on the admin paths (403 for a tenant key);
- ``KeyLimitMiddleware`` (``pd.server.http.key_limits``): each key's requests in flight and tokens
  per minute (429);
- ``BodyLimitMiddleware``: a body larger than the cap is 413, on its Content-Length before
  anything is read, or as soon as the bytes read (of a chunked body) pass the cap; a body not
  in within the body-read deadline is 408, and its connection is closed; a body that would
  take the bytes of all bodies being received past their cap is 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import socket
import struct
import termios
import time
from typing import Any

import anyio
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pd.server.http.admission import RETRY_AFTER_S
from pd.server.http.auth import API_KEY_SCOPE, ROLE_SCOPE, ApiKeys, Role
from pd.server.http.errors import APIError, internal_error, rate_limited
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
        except ClientStalled:
            raise  # WriteTimeoutMiddleware's: not a failure of the server
        except ClientDisconnect:
            return  # the client left while its body was read: nobody to answer
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
    """Each body at most ``max_bytes``, in within ``read_timeout_s``; the bodies being received
    hold at most ``max_bytes_in_flight`` together. A body holds its Content-Length from its
    start (a chunked one, the bytes read so far) until it is in or its request ends."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        read_timeout_s: float,
        max_bytes_in_flight: int,
        metrics: ServerMetrics,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s
        self.max_bytes_in_flight = max_bytes_in_flight
        self.metrics = metrics
        self.num_bytes_in_flight = 0

    def _can_hold(self, num_bytes: int) -> bool:
        return self.num_bytes_in_flight + num_bytes <= self.max_bytes_in_flight

    def _too_many_in_flight(self, num_bytes: int) -> APIError:
        self.metrics.rejected.labels(reason="bodies_in_flight").inc()
        return rate_limited(
            f"server overloaded: {self.num_bytes_in_flight} bytes of request bodies being "
            f"received, this one's {num_bytes} would pass the cap of "
            f"{self.max_bytes_in_flight}; retry later",
            "server_overloaded",
            RETRY_AFTER_S,
        )

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
        num_held = int(length) if declared and length is not None else 0
        if not self._can_hold(num_held):
            await self._too_many_in_flight(num_held).response()(scope, receive, send)
            return
        self.num_bytes_in_flight += num_held
        num_read = 0
        is_complete = False
        deadline = time.monotonic() + self.read_timeout_s

        async def receive_capped() -> Message:
            nonlocal num_read, is_complete, num_held
            if is_complete:  # what follows the body (a disconnect) has no deadline
                return await receive()
            with anyio.move_on_after(deadline - time.monotonic()):
                message = await receive()
                if message["type"] == "http.request":
                    num_read += len(message.get("body", b""))
                    if num_read > self.max_bytes:
                        raise BodyRefused(self._too_large(f"more than {self.max_bytes}"))
                    if num_read > num_held:  # a chunked body: held as it comes
                        if not self._can_hold(num_read - num_held):
                            raise BodyRefused(self._too_many_in_flight(num_read))
                        self.num_bytes_in_flight += num_read - num_held
                        num_held = num_read
                    is_complete = not message.get("more_body", False)
                    if is_complete:
                        self.num_bytes_in_flight -= num_held
                        num_held = 0
                return message
            raise BodyRefused(self._too_slow(num_read))

        try:
            await self.app(scope, receive_capped, send)
        finally:
            self.num_bytes_in_flight -= num_held

    def _too_slow(self, num_read: int) -> APIError:
        self.metrics.rejected.labels(reason="body_timeout").inc()
        return APIError(
            f"the request body did not arrive within {self.read_timeout_s:g} s "
            f"({num_read} bytes came); the connection is closed",
            status_code=408,
            type="timeout_error",
            code="body_timeout",
            headers={"Connection": "close"},
        )


class BodyRefused(HTTPException):
    """``error`` (413, 408), raised while the body is read. An ``HTTPException``, so that
    FastAPI's own body parsing passes it on (it answers 400 to any other error there); the
    app's handler answers ``error``."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.status_code, error.message, error.headers)
        self.error = error


class ClientStalled(Exception):
    """The client took none of the response's bytes for the write timeout (raised by the
    ``send`` that waited)."""


class WriteTimeoutMiddleware:
    """Bounds how long a ``send`` waits on a client that takes nothing: ``timeout_s``. uvicorn's
    ``send`` waits while the connection's write buffer is full (its client reads nothing, or
    slowly, so its socket buffers are full too); once the client has taken none of the buffer's
    bytes for the bound the connection is reset (closing it gracefully would wait for that client to
    read), and that ``send`` and any later one raise ``ClientStalled``: a stream then closes its
    generator, which aborts the request and releases its place. The app's call ends quietly
    here, counted as ``client_gone{where="stalled"}``.

    Outermost, outside Starlette's own middleware, so that ``send`` is the server's own: its
    connection is reachable there (``_BoundedSend``)."""

    def __init__(self, app: ASGIApp, timeout_s: float, metrics: ServerMetrics) -> None:
        self.app = app
        self.timeout_s = timeout_s
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        bounded = _BoundedSend(send, self.timeout_s, self.metrics)
        try:
            await self.app(scope, receive, bounded.send)
        except ClientStalled:
            if not bounded.is_stalled:
                raise
        finally:
            bounded.close()


class _BoundedSend:
    """One response's ``send``, each call bounded by ``timeout_s``.

    Under uvicorn, ``send`` is a method of its request-response cycle, which holds the asyncio
    transport: a watchdog timer (one per response, looking 4 times per ``timeout_s`` while a
    send is pending) resets the connection once its client has taken none of its bytes (in
    uvicorn's write buffer or the kernel's send queue) for that long, and uvicorn's ``send`` returns at once when its connection
    is lost; a send costs two assignments. A client that reads slowly but steadily is not cut:
    a send waits for the buffer to drain from its high-water mark to its low one (48 KiB), and
    at 5 KiB/s that outlasts an 8 s timeout (the chaos soak's slow readers were cut so). Under any other server,
    each send waits in a cancel scope of its own (the server closes the connection when the
    app returns)."""

    def __init__(self, send: Send, timeout_s: float, metrics: ServerMetrics) -> None:
        self._send = send
        self._timeout_s = timeout_s
        self._metrics = metrics
        self._transport: Any = getattr(getattr(send, "__self__", None), "transport", None)
        if not hasattr(self._transport, "abort"):
            self._transport = None
        self._loop = asyncio.get_running_loop()
        # when the pending send began, or its client last took bytes
        self._since: float | None = None
        self._buffered: int | None = None  # bytes not yet taken at the last look
        self._look_s = timeout_s / 4  # how often a pending send's buffer is looked at
        self._timer: asyncio.TimerHandle | None = None
        self.is_stalled = False

    async def send(self, message: Message) -> None:
        if not self.is_stalled:
            if self._transport is None:
                with anyio.move_on_after(self._timeout_s):
                    await self._send(message)
                    return
                self._on_stalled()
            else:
                self._since, self._buffered = self._loop.time(), None
                if self._timer is None:
                    self._timer = self._loop.call_at(self._since + self._look_s, self._check)
                try:
                    await self._send(message)
                finally:
                    self._since = None
                if not self.is_stalled:
                    return
        raise ClientStalled(f"the client took nothing for {self._timeout_s:g} s")

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _check(self) -> None:
        self._timer = None
        if self._since is None:  # no send pending: the next one re-arms
            return
        now = self._loop.time()
        buffered = self._unsent()
        if self._buffered is not None and buffered < self._buffered:
            self._since = now  # the client took bytes: a slow reader, not a stalled one
        self._buffered = buffered
        if now - self._since < self._timeout_s:
            self._timer = self._loop.call_at(
                min(now + self._look_s, self._since + self._timeout_s), self._check
            )
            return
        self._on_stalled()
        # a reset (SO_LINGER 0), not a close: a closed socket would keep its unsent bytes in
        # the kernel for a client that reads nothing
        sock = self._transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._transport.abort()

    def _unsent(self) -> int:
        """Bytes the client has not taken: uvicorn's write buffer and the kernel's send queue
        (which takes more only once a third of it is free: with a send buffer of hundreds of
        KiB, uvicorn's alone would stand still for seconds while the client reads)."""
        num = self._transport.get_write_buffer_size()
        sock = self._transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, ValueError):
                out = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
                num += struct.unpack("i", out)[0]
        return num

    def _on_stalled(self) -> None:
        self.is_stalled = True
        self._metrics.client_gone.labels(where="stalled").inc()
