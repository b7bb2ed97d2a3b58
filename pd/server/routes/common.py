"""The path every generation endpoint takes, whatever its request and response shapes.

1. the body, read under the size cap (413) and the body-read deadline (408, the connection
   closed; both by the middleware), before admission: a slow body never holds a place;
2. admission (503 while the engine is not ready or the server shuts down, 429 when full, a
   queue in between, left at once when the client disconnects);
3. parsing, checking, templating and tokenizing in a parse thread (``prepare``; 4xx);
4. the engine run, bounded by the request's deadline (504, or an error event on a stream);
   each write of the response is bounded too (``WriteTimeoutMiddleware``).

The admission place is released when the response is over: at once for an error or a plain
answer; for a stream, when its generation ends and what its client has not read yet fits the
server's budget for slow readers (``pd.server.stream_buffer``), or when the stream ends,
however it ends, if that comes first. A client that leaves is counted
(``pd_server_client_gone_total``) and answered nothing (499 in the access log).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from pd.server.admission import AdmissionTicket
from pd.server.auth import API_KEY_SCOPE
from pd.server.errors import validation_error
from pd.server.generation import Generation, Step
from pd.server.key_limits import TOKEN_METER_SCOPE
from pd.server.state import Prepared, ServerState
from pd.server.streaming import ClientGone, sse_response, sse_steps

Prepare = Callable[[ServerState, bytes, "str | None"], Prepared]


class Renderer(Protocol):
    """An endpoint's response shapes."""

    def chunk(self, gen: Generation, step: Step) -> BaseModel | None: ...

    def usage(self, gen: Generation) -> BaseModel: ...

    def first(self, gen: Generation) -> BaseModel | None: ...

    def final(self, gen: Generation) -> BaseModel: ...


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def parse_body(model: type[Any], body: bytes) -> Any:
    """A request model from a JSON body (in a parse thread: a big body takes a while)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` documenting a body the handler parses itself."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


async def serve_generation(
    request: Request, prefix: str, prepare: Prepare, render: Renderer
) -> Response:
    state = server_state(request)
    timeout_s = state.config.request_timeout
    deadline = time.monotonic() + timeout_s
    try:
        body = await request.body()
    except ClientDisconnect:
        state.metrics.client_gone.labels(where="body").inc()
        return Response(status_code=499)
    try:
        ticket: AdmissionTicket | None = await state.admit(request, timeout_s)
    except ClientGone:
        return Response(status_code=499)
    try:
        prep = await state.in_thread(prepare, state, body, request.scope.get(API_KEY_SCOPE))
        gen = state.new_generation(prefix, prep)
        gen.on_tokens = request.scope.get(TOKEN_METER_SCOPE)  # per-key tokens per minute
        if prep.stream:
            steps = sse_steps(
                gen,
                lambda step: render.chunk(gen, step),
                (lambda: render.usage(gen)) if prep.include_usage else None,
                render.first(gen),
                deadline,
                state.timed_out,
            )
            left = state.metrics.client_gone.labels(where="running")
            response = sse_response(
                steps,
                on_close=ticket.release,
                on_gone=left.inc,
                max_buffer_bytes=state.config.max_stream_buffer_bytes,
                budget=state.stream_bytes,
            )
            ticket = None  # the response releases it
            return response
        if (gone := await state.run(request, gen, deadline)) is not None:
            return gone
        return Response(render.final(gen).model_dump_json(), media_type="application/json")
    finally:
        if ticket is not None:
            ticket.release()
