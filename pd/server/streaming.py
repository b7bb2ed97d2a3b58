"""SSE framing, client-disconnect handling and deadlines of the HTTP server.

A stream is ``data: {json}\\n\\n`` events ending with the raw ``data: [DONE]\\n\\n`` sentinel.
A client that leaves a stream cancels its generator (the abort happens in ``Generation``);
a plain handler is not cancelled by the server, so ``cancel_on_disconnect`` watches for it.
A request past its deadline is cancelled the same way (so aborted on the engine) and answered
with a timeout error (an error event, then ``[DONE]``, on a stream).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from pd.server.errors import APIError, internal_error
from pd.server.generation import Generation

logger = logging.getLogger(__name__)

T = TypeVar("T")

_DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else _json(payload)
    return f"data: {body}\n\n"


def _json(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"))


class ClientGone(Exception):
    pass


class DeadlineExceeded(Exception):
    pass


async def cancel_on_disconnect(request: Request, coro: Awaitable[T], timeout_s: float) -> T:
    """Await ``coro``; cancel it if the client disconnects first (``ClientGone``; a plain
    handler is not cancelled by the server when its client goes away, only streams are) or
    when ``timeout_s`` passes (``DeadlineExceeded``)."""

    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait(
            {task, watcher}, timeout=max(timeout_s, 0.0), return_when=asyncio.FIRST_COMPLETED
        )
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


class _ReleasingStreamingResponse(StreamingResponse):
    """Calls ``on_close`` once the response is over, however it ends (sent, client gone, or
    never started): the place the request holds is released exactly once."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse_response(body: AsyncIterator[str], on_close: Callable[[], None]) -> StreamingResponse:
    return _ReleasingStreamingResponse(body, on_close)


async def anext_or_none(it: AsyncIterator[T]) -> T | None:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None


async def sse_steps(
    gen: Generation,
    make_chunk: Callable[[str, list[int], str | None], BaseModel | None],
    usage_chunk: Callable[[], BaseModel] | None,
    first: BaseModel | None,
    deadline: float,
    on_timeout: Callable[[], APIError],
) -> AsyncIterator[str]:
    """SSE lines of one request; an engine failure mid-stream becomes an error event, and so
    does the deadline (``time.monotonic()``) passing."""
    try:
        if first is not None:
            yield sse_event(first)
        async with aclosing(gen.steps()) as steps:
            while True:
                # Only the wait is in the scope (never a yield): past the deadline it cancels
                # the step, which aborts the engine request.
                with anyio.move_on_after(deadline - time.monotonic()) as scope:
                    step = await anext_or_none(steps)
                if scope.cancelled_caught:
                    raise DeadlineExceeded()
                if step is None:
                    break
                chunk = make_chunk(*step)
                if chunk is not None:
                    yield sse_event(chunk)
        if usage_chunk is not None:
            yield sse_event(usage_chunk())
    except DeadlineExceeded:
        yield sse_event(on_timeout().to_dict())
    except Exception as e:
        logger.exception("stream %s failed", gen.request_id)
        yield sse_event(internal_error(e).to_dict())
    yield _DONE
