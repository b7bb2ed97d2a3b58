"""A stream's answer between the engine and a client that reads it slower.

Each stream has a ``StreamPipe``: the SSE bytes its request produced that its client has not
taken yet. The request's side (``put``) runs as fast as the engine, so the engine's stream and
the request's booking end when its generation does, whoever reads; it waits only while the
pipe holds ``max_stream_buffer_bytes`` (a client that far behind keeps its request waiting, as
it would without a pipe). The connection's side (``take``) hands those bytes to the socket as
fast as the client reads them.

Once a request's generation has ended (``close``), its admission place goes back
(``on_generated``) as soon as the bytes still in its pipe fit under ``StreamBytes``, the
server-wide budget of streams that hold no place (``max_released_stream_bytes``); until then
it keeps the place and tries again as its client reads. So a slow client holds a place while
its request generates, not while it reads, and the bytes the server holds for slow clients
are bounded: ``max_inflight_requests`` x (``max_stream_buffer_bytes`` + one event) for the
requests that hold a place, plus ``max_released_stream_bytes`` for those that gave it back
(plus per connection what uvicorn's transport and the kernel buffer: ~64 KiB + the socket's).
Behind a pipe that waits, its request's token messages queue up to ``max_stream_buffer_bytes``
too, and its nodes pause it there (``pd.core.backlog``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

# Bytes one send hands the socket at most: a reader far behind gets its backlog in pieces
# that uvicorn's 64 KiB write buffer takes whole.
MAX_SEND_BYTES = 64 << 10


class StreamBytes:
    """The server-wide budget of bytes held for streams whose generation ended and whose
    admission place went back (module docstring)."""

    def __init__(self, max_bytes: int) -> None:
        assert max_bytes >= 0, max_bytes
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_streams = 0  # streams holding bytes of this budget
        self._empty = asyncio.Event()
        self._empty.set()

    def try_hold(self, num_bytes: int) -> bool:
        """Hold ``num_bytes`` for one more stream, if they fit."""
        if self.num_bytes + num_bytes > self.max_bytes:
            return False
        self.num_bytes += num_bytes
        self.num_streams += 1
        self._empty.clear()
        return True

    def give_back(self, num_bytes: int, is_last: bool) -> None:
        """``num_bytes`` of a stream's were taken (``is_last``: that stream holds none now)."""
        self.num_bytes -= num_bytes
        self.num_streams -= is_last
        assert self.num_bytes >= 0 and self.num_streams >= 0, (self.num_bytes, self.num_streams)
        if self.num_streams == 0:
            assert self.num_bytes == 0, self.num_bytes
            self._empty.set()

    async def wait_empty(self) -> None:
        """Return once no stream holds bytes here (a graceful shutdown waits for them)."""
        await self._empty.wait()


class StreamPipe:
    """One stream's bytes between its request and its connection (module docstring).

    1. ``put`` (the request's side) until ``close`` (its generation ended, or failed);
    2. ``take`` (the connection's side) until it returns None: closed and empty;
    3. ``on_generated`` is called exactly once, when the pipe is closed and its bytes left
       fit under ``budget`` (they are held there until taken), or by ``end`` (the response
       is over, however it ended), which also gives back whatever the budget holds for it.
    """

    def __init__(
        self, max_bytes: int, budget: StreamBytes, on_generated: Callable[[], None]
    ) -> None:
        assert max_bytes >= 1, max_bytes
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.is_closed = False
        self.is_released = False  # its place went back; its bytes are held by the budget
        self._budget = budget
        self._on_generated: Callable[[], None] | None = on_generated
        self._chunks: deque[bytes] = deque()
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()

    async def put(self, data: bytes) -> None:
        """Add ``data``, after waiting while the pipe holds ``max_bytes`` (an event may take
        it past, by that event's size)."""
        assert not self.is_closed, "put after close"
        while self.num_bytes >= self.max_bytes:
            self._writable.clear()
            await self._writable.wait()
        self._chunks.append(data)
        self.num_bytes += len(data)
        self._readable.set()

    def close(self) -> None:
        """Nothing more will be put: the request's generation is over."""
        self.is_closed = True
        self._readable.set()
        self._try_release()

    async def take(self) -> bytes | None:
        """The next bytes for the socket (at most ``MAX_SEND_BYTES`` unless one event is
        larger), waiting for some; None once closed and empty."""
        while not self._chunks:
            if self.is_closed:
                return None
            self._readable.clear()
            await self._readable.wait()
        parts = [self._chunks.popleft()]
        size = len(parts[0])
        while self._chunks and size + len(self._chunks[0]) <= MAX_SEND_BYTES:
            parts.append(self._chunks.popleft())
            size += len(parts[-1])
        self.num_bytes -= size
        self._writable.set()
        if self.is_released:
            self._budget.give_back(size, is_last=not self._chunks)
            if not self._chunks:
                self.is_released = False  # held nothing more: given back whole
        else:
            self._try_release()
        return b"".join(parts)

    def end(self) -> None:
        """The response is over (sent, client gone, cut off): the place goes back if it has
        not, and the budget gets back what it holds for this stream."""
        if self.is_released:
            self._budget.give_back(self.num_bytes, is_last=True)
            self.is_released = False
        self._chunks.clear()
        self.num_bytes = 0
        self._release_place()

    def _try_release(self) -> None:
        if self.is_closed and self._on_generated is not None:
            if not self._chunks:
                self._release_place()  # nothing left: the budget holds nothing for it
            elif self._budget.try_hold(self.num_bytes):
                self.is_released = True
                self._release_place()

    def _release_place(self) -> None:
        on_generated, self._on_generated = self._on_generated, None
        if on_generated is not None:
            on_generated()
