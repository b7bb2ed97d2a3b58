"""The HTTP listener under uvicorn: what a connection may hold before the app sees a request.

uvicorn's HTTP/1.1 protocol (h11) starts no timer between a connection's opening and its
request's head and counts no connections: a client that connects and sends nothing, or half a
head, holds a socket and a file descriptor for ever, and a thousand of them use up a default
open-file limit of 1,024. Here:

- ``raise_fd_limit``: the process's open-file limit raised to its hard limit, at start;
- ``Listener``: at most ``max_connections`` open at once (one more is answered 503 and closed
  at once); a request's head due within ``header_timeout_s`` of the connection's opening, or
  of the first byte after its previous answer (slower: 408 and closed). Until its head is in,
  a connection holds at most h11's 16 KiB of head and one read of the socket (256 KiB).
- TLS (``ssl_context``) runs inside the guard, not under uvicorn: asyncio's own TLS makes the
  protocol only once the handshake is done, and tells it nothing of one that fails or never
  ends. Here a TCP connection counts from its accept, its handshake runs on the head's
  deadline (one that is not done by then is closed without an answer: there is no channel
  to write one on; one over the limit likewise), and it is released when the socket closes
  (a close waits for the client's close_notify at most the header deadline).

uvicorn's ``limit_concurrency`` would not do: it answers 503 only once a head is in, so the
silent connections it should bound are never counted against it.
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
import resource
import ssl
from asyncio import sslproto
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from pd.server.http.errors import APIError
from pd.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

MAX_DEFAULT_CONNECTIONS = 10_000
_UNLIMITED_FILES = 1 << 20  # what "unlimited" becomes: Linux's default ceiling (nr_open)


def raise_fd_limit() -> int:
    """Raise this process's soft open-file limit (``RLIMIT_NOFILE``) to its hard limit, and
    return the soft limit now in force (unchanged if the raise is refused)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _UNLIMITED_FILES if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= target:
        return _UNLIMITED_FILES if soft == resource.RLIM_INFINITY else soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as e:
        logger.warning("open-file limit stays %d: raising it to %d failed: %s", soft, target, e)
        return soft
    logger.info("open-file limit raised from %d to %d", soft, target)
    return target


def max_connections_for(max_connections: int, fd_limit: int) -> int:
    """``max_connections``, or when 0 half of ``fd_limit`` (the other half for the engine,
    its files and its sockets), at most ``MAX_DEFAULT_CONNECTIONS``."""
    if max_connections:
        return max_connections
    return max(1, min(fd_limit // 2, MAX_DEFAULT_CONNECTIONS))


def _raw_answer(error: APIError) -> bytes:
    """``error`` as a whole HTTP/1.1 response that closes its connection: written straight
    to a socket, where no request (or no h11 state) is there to answer."""
    body = json.dumps(error.to_dict(), separators=(",", ":")).encode()
    headers = {
        "content-type": "application/json",
        "content-length": str(len(body)),
        "connection": "close",
        **error.headers,
    }
    phrase = http.HTTPStatus(error.status_code).phrase
    head = f"HTTP/1.1 {error.status_code} {phrase}\r\n"
    head += "".join(f"{name.lower()}: {value}\r\n" for name, value in headers.items())
    return (head + "\r\n").encode() + body


class Listener:
    """The HTTP connections of one server: how many are open, and their head deadline.
    ``protocol`` is what ``uvicorn.Config(http=...)`` takes: each connection gets a
    ``_GuardedConnection`` around uvicorn's own h11 protocol."""

    def __init__(
        self,
        max_connections: int,
        header_timeout_s: float,
        metrics: ServerMetrics,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        assert max_connections >= 1 and header_timeout_s > 0, (max_connections, header_timeout_s)
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.ssl_context = ssl_context  # TLS inside each guarded connection (module docstring)
        self.num_open = 0
        self._metrics = metrics
        self._too_many = _raw_answer(
            APIError(
                f"too many connections: {max_connections} are open; retry later",
                status_code=503,
                type="server_error",
                code="too_many_connections",
                headers={"Retry-After": "1"},
            )
        )
        self._too_slow = _raw_answer(
            APIError(
                f"the request's head did not arrive within {header_timeout_s:g} s; the "
                "connection is closed",
                status_code=408,
                type="timeout_error",
                code="header_timeout",
            )
        )

    def protocol(self, **uvicorn_kwargs: Any) -> asyncio.Protocol:
        """A new connection's protocol (uvicorn passes its config and state)."""
        return _GuardedConnection(self, lambda: H11Protocol(**uvicorn_kwargs))

    def can_open(self) -> bool:
        return self.num_open < self.max_connections

    def open(self) -> None:
        assert self.can_open(), (self.num_open, self.max_connections)
        self.num_open += 1

    def close(self) -> None:
        assert self.num_open > 0
        self.num_open -= 1

    def refuse(self, transport: asyncio.Transport) -> None:
        """One connection too many: 503 (over TLS, before a handshake: nothing), closed."""
        self._metrics.rejected.labels(reason="too_many_connections").inc()
        if self.ssl_context is None:
            transport.write(self._too_many)
        transport.close()

    def time_out(self, transport: asyncio.Transport, answer_on: asyncio.Transport | None) -> None:
        """A head (or a TLS handshake) not in by its deadline: 408 on ``answer_on`` (the
        socket's ``transport``, or TLS over it; none before a handshake), and the socket
        closed (over TLS without waiting for the client's close_notify)."""
        self._metrics.rejected.labels(reason="header_timeout").inc()
        if answer_on is not None:
            answer_on.write(self._too_slow)
        transport.close()


class _GuardedConnection(asyncio.Protocol):
    """One TCP connection: counted by its listener, uvicorn's h11 protocol inside (made only
    once the connection is admitted; over TLS, behind asyncio's ``SSLProtocol``), and a timer
    on each request head. The timer runs while no request is in progress and something is
    awaited: from the opening (a TLS handshake included), and from the first byte after a
    response; a head that comes in (a new request of the h11 protocol) stops it.
    """

    def __init__(self, listener: Listener, make_inner: Callable[[], H11Protocol]) -> None:
        self._listener = listener
        self._make_inner = make_inner
        self._h11: H11Protocol | None = None
        # what reads the socket: the h11 protocol, or TLS around it; None: refused
        self._inner: H11Protocol | sslproto.SSLProtocol | None = None
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._request: object | None = None  # the last request whose head came in

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        if not self._listener.can_open():
            self._listener.refuse(transport)
            return
        self._listener.open()
        self._h11 = self._make_inner()
        ctx = self._listener.ssl_context
        if ctx is None:
            self._inner = self._h11
        else:
            loop = asyncio.get_running_loop()
            # a close waits for the client's close_notify no longer than a head may take
            timeout = self._listener.header_timeout_s
            self._inner = sslproto.SSLProtocol(
                loop, self._h11, ctx, None, server_side=True, ssl_shutdown_timeout=timeout
            )
        self._inner.connection_made(transport)
        self._start_timer()

    def data_received(self, data: bytes) -> None:
        if self._inner is None or self._h11 is None:  # refused: closing
            return
        if isinstance(self._inner, sslproto.SSLProtocol):
            _feed(self._inner, data)  # decrypted, it reaches the h11 protocol before this returns
        else:
            self._inner.data_received(data)
        request = self._h11.cycle
        if request is not self._request:  # a head came in
            self._request = request
            self._stop_timer()
        elif self._timer is None and (request is None or request.response_complete):
            self._start_timer()  # the first bytes after an answer: the next head's

    def eof_received(self) -> bool | None:
        return None if self._inner is None else self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        if self._inner is not None:
            self._listener.close()
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def _start_timer(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._listener.header_timeout_s, self._on_deadline)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_deadline(self) -> None:
        self._timer = None
        assert self._transport is not None and self._h11 is not None
        if self._transport.is_closing():
            return
        # TLS: the h11 protocol has a transport once the handshake is done
        self._listener.time_out(self._transport, self._h11.transport)


def _feed(protocol: asyncio.BufferedProtocol, data: bytes) -> None:
    """``data`` into a buffered protocol, through the buffers it hands out."""
    view = memoryview(data)
    while view:
        buf = memoryview(protocol.get_buffer(len(view)))
        n = min(len(buf), len(view))
        buf[:n] = view[:n]
        protocol.buffer_updated(n)
        view = view[n:]
