"""SSE framing and client-disconnect handling of the HTTP server.

A stream is ``data: {json}\\n\\n`` events ending with the raw ``data: [DONE]\\n\\n`` sentinel.
A client that leaves a stream cancels its generator (the abort happens in ``Generation``);
a plain handler is not cancelled by the server, so ``cancel_on_disconnect`` watches for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from pd.server.generation import Generation
from pd.server.protocol import APIError

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


async def cancel_on_disconnect(request: Request, coro: Awaitable[T]) -> T:
    """Await ``coro``; cancel it if the client disconnects first (a plain handler is not
    cancelled by the server when its client goes away, only streams are)."""

    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


def sse_response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def sse_steps(
    gen: Generation,
    make_chunk: Callable[[str, list[int], str | None], BaseModel | None],
    usage_chunk: Callable[[], BaseModel] | None,
    first: BaseModel | None = None,
) -> AsyncIterator[str]:
    """SSE lines of one request; an engine failure mid-stream becomes an error event."""
    try:
        if first is not None:
            yield sse_event(first)
        async with aclosing(gen.steps()) as steps:
            async for text, ids, finish_reason in steps:
                chunk = make_chunk(text, ids, finish_reason)
                if chunk is not None:
                    yield sse_event(chunk)
        if usage_chunk is not None:
            yield sse_event(usage_chunk())
    except Exception as e:
        logger.exception("stream %s failed", gen.request_id)
        err = APIError(f"internal error: {e!r}", status_code=500, type="server_error")
        yield sse_event(err.to_dict())
    yield _DONE
