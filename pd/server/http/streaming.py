"""SSE framing, client-disconnect handling and deadlines of the HTTP server.

A stream is ``data: {json}\\n\\n`` events ending with the raw ``data: [DONE]\\n\\n`` sentinel.
Its request generates into a pipe (``pd.server.http.stream_buffer``) that the connection empties
as its client reads: a slow reader holds its admission place while its request generates, not
while it reads the rest. A stream that ends early (its client left, or stopped reading and was
cut off by ``pd.server.http.middleware.WriteTimeoutMiddleware``) closes its generator at once,
which aborts the request on the engine (in ``Generation``); a plain handler is not cancelled by
the server, so ``cancel_on_disconnect`` watches for its client leaving (and for one leaving the
admission queue). A request past its deadline is cancelled the same way (so aborted on the
engine) and answered with a timeout error (an error event, then ``[DONE]``, on a stream); so
is one its engine ended because its client, paused behind, did not catch up
(``ReaderStalled``, ``pd.core.backlog``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Message, Receive, Scope, Send

from pd.core.backlog import ReaderStalled
from pd.server.generation import Choices, Step
from pd.server.http.errors import APIError, internal_error, stalled_error
from pd.server.http.stream_buffer import StreamBytes, StreamPipe

logger = logging.getLogger(__name__)

T = TypeVar("T")

_DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict[str, Any] | str) -> str:
    """An event of ``payload``: a model, a dict, or JSON already encoded (a str)."""
    if isinstance(payload, str):
        body = payload
    elif isinstance(payload, BaseModel):
        body = payload.model_dump_json()
    else:
        body = _json(payload)
    return f"data: {body}\n\n"


def _json(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"))


class ClientGone(Exception):
    pass


class DeadlineExceeded(Exception):
    pass


async def cancel_on_disconnect(request: Request, coro: Awaitable[T], timeout_s: float | None) -> T:
    """Await ``coro``; cancel it if the client disconnects first (``ClientGone``; a plain
    handler is not cancelled by the server when its client goes away, only streams are) or
    when ``timeout_s`` passes (``DeadlineExceeded``; None: ``coro`` bounds itself). Only once
    the request's body is read: the watcher takes what the client sends."""

    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        timeout = None if timeout_s is None else max(timeout_s, 0.0)
        await asyncio.wait({task, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        if watcher.done() and not watcher.cancelled():
            raise ClientGone()
        raise DeadlineExceeded()
    return task.result()


class _PipedStreamingResponse(StreamingResponse):
    """Runs its generator (the request's SSE text) in a task of its own into a ``StreamPipe``
    and sends what the pipe holds as the client takes it, so the request generates at the
    engine's pace, not its client's. ``on_close`` (the admission place) is called exactly once:
    when the generation has ended and the pipe's bytes fit the server's ``StreamBytes``, or
    when the response is over, however it ends (sent, client gone, cut off, never started); the
    generator is closed then too, so a request cut short is aborted at once. ``on_gone`` when
    its client left before the end."""

    def __init__(
        self,
        body: AsyncGenerator[str, None],
        pipe: StreamPipe,
        on_gone: Callable[[], None],
    ) -> None:
        super().__init__(
            self._sends(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._body = body
        self._pipe = pipe
        self._on_gone = on_gone

    async def _pump(self) -> None:
        try:
            async for text in self._body:
                await self._pipe.put(text.encode())
        finally:
            self._pipe.close()

    async def _sends(self) -> AsyncGenerator[bytes, None]:
        while (data := await self._pipe.take()) is not None:
            yield data

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        is_sent = False

        async def send_tracking(message: Message) -> None:
            nonlocal is_sent
            await send(message)
            is_sent = message["type"] == "http.response.body" and not message.get("more_body")

        pump = asyncio.ensure_future(self._pump())
        try:
            await super().__call__(scope, receive, send_tracking)
            if not is_sent:  # it returned early: the client disconnected
                self._on_gone()
        finally:
            with anyio.CancelScope(shield=True):  # bounded: Generation bounds its abort
                pump.cancel()  # a no-op once the generation is over
                await asyncio.gather(pump, return_exceptions=True)
                await self._body.aclose()
            self._pipe.end()


def sse_response(
    body: AsyncGenerator[str, None],
    on_close: Callable[[], None],
    on_gone: Callable[[], None],
    max_buffer_bytes: int,
    budget: StreamBytes,
) -> StreamingResponse:
    """The response of a stream: ``on_close`` gives its admission place back once its
    generation ends and its unsent bytes (at most ``max_buffer_bytes``, then the request
    waits) fit ``budget``, or when the response is over (``pd.server.http.stream_buffer``)."""
    pipe = StreamPipe(max_buffer_bytes, budget, on_close)
    return _PipedStreamingResponse(body, pipe, on_gone)


async def anext_or_none(it: AsyncIterator[T]) -> T | None:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None


async def sse_steps(
    choices: Choices,
    make_chunk: Callable[[int, Step], BaseModel | str | None],
    usage_chunk: Callable[[], BaseModel | None] | None,
    first: BaseModel | None,
    deadline: float,
    on_timeout: Callable[[], APIError],
) -> AsyncGenerator[str, None]:
    """SSE lines of one request (its choices' steps as they come, each chunk for one choice);
    an engine failure mid-stream becomes an error event, and so does the deadline
    (``time.monotonic()``) passing."""
    try:
        if first is not None:
            yield sse_event(first)
        async with aclosing(choices.steps()) as steps:
            while True:
                # Only the wait is in the scope (never a yield): past the deadline it cancels
                # the step, which aborts the engine request. asyncio's own timeout: a timer,
                # where anyio's scope costs several times as much, once per token.
                timeout = asyncio.timeout(deadline - time.monotonic())
                try:
                    async with timeout:
                        step = await anext_or_none(steps)
                except TimeoutError:
                    if not timeout.expired():  # the engine's own (its request's deadline)
                        raise
                    raise DeadlineExceeded() from None
                if step is None:
                    break
                chunk = make_chunk(*step)
                if chunk is not None:
                    yield sse_event(chunk)
        if usage_chunk is not None and (usage := usage_chunk()) is not None:
            yield sse_event(usage)
    except DeadlineExceeded:
        yield sse_event(on_timeout().to_dict())
    except ReaderStalled as e:  # its client fell behind and did not catch up: it was ended
        yield sse_event(stalled_error(e).to_dict())
    except ValueError as e:  # the engine refused the request for its own fault (its grammar)
        yield sse_event(APIError(str(e)).to_dict())
    except Exception as e:
        logger.exception("stream %s failed", choices.request_id)
        yield sse_event(internal_error(e).to_dict())
    yield _DONE
