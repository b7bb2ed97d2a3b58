"""The path every generation endpoint takes, whatever its request and response shapes.

1. the body, read under the size cap (413) and the body-read deadline (408, the connection
   closed; both by the middleware), before admission: a slow body never holds a place;
2. admission (503 while the engine is not ready or the server shuts down, 429 when full, a
   queue in between ordered by priority, left at once when the client disconnects): a request
   of ``n`` choices takes ``n`` places, and counts ``n`` against its key's requests in flight
   (``peek_admission``: read from the body before it is fully parsed);
3. parsing, checking, templating and tokenizing in a parse thread (``prepare``; 4xx);
4. the engine run, bounded by the request's deadline (504, or an error event on a stream);
   each write of the response is bounded too (``WriteTimeoutMiddleware``).

The admission place is released when the response is over: at once for an error or a plain
answer; for a stream, when its generation ends and what its client has not read yet fits the
server's budget for slow readers (``pd.server.http.stream_buffer``), or when the stream ends,
however it ends, if that comes first. A client that leaves is counted
(``pd_server_client_gone_total``) and answered nothing (499 in the access log).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import ClientDisconnect

from pd.server.checks import Prepared, RequestChecks
from pd.server.generation import Choices, Step
from pd.server.http.admission import AdmissionTicket
from pd.server.http.auth import API_KEY_SCOPE
from pd.server.http.errors import APIError, validation_error
from pd.server.http.key_limits import TOKEN_BUDGET_SCOPE, TOKEN_METER_SCOPE, WIDEN_SCOPE
from pd.server.http.streaming import ClientGone, sse_response, sse_steps
from pd.server.openai.protocol import MAX_N
from pd.server.state import ServerState

# parses, checks and tokenizes a body in a parse thread (given the API key the request carried)
Prepare = Callable[[RequestChecks, bytes, "str | None"], Prepared]
_INLINE_PEEK_BYTES = 16 << 10  # a body this small is peeked at on the event loop (microseconds)


class Renderer(Protocol):
    """One request's response shapes, an endpoint's kind of them: built from the served
    model's name and the request's choices (``MakeRenderer``), each method a model or None."""

    def first(self) -> BaseModel | None:
        """A stream's opening chunk, if it has one."""
        ...

    def chunk(self, index: int, step: Step) -> BaseModel | str | None:
        """A stream's chunk of choice ``index`` for one of its steps (None: nothing to send;
        a str: the chunk's JSON, encoded already)."""
        ...

    def usage(self) -> BaseModel | None:
        """A stream's usage chunk, when the request asks for one."""
        ...

    def final(self) -> BaseModel:
        """The answer of a request that does not stream."""
        ...


MakeRenderer = Callable[[str, Choices], Renderer]


class _AdmissionFields(BaseModel):
    """What admission needs of a body (the rest is parsed after it): any other shape parses
    as the defaults here, and the full parse answers it."""

    model_config = ConfigDict(extra="ignore", strict=True)
    n: int = 1
    priority: int | None = None


def peek_admission(body: bytes) -> _AdmissionFields:
    try:
        fields = _AdmissionFields.model_validate_json(body)
    except ValidationError:
        return _AdmissionFields()
    if fields.n < 1:  # refused by the full parse
        fields.n = 1
    return fields


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def parse_body(model: type[Any], body: bytes) -> Any:
    """A request model from a JSON body (in a parse thread: a big body takes a while)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def _final_json(render: Renderer) -> str:
    return render.final().model_dump_json()


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` documenting a body the handler parses itself."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


async def serve_generation(
    request: Request, prefix: str, prepare: Prepare, make_renderer: MakeRenderer
) -> Response:
    state = server_state(request)
    timeout_s = state.config.request_timeout
    deadline = time.monotonic() + timeout_s
    try:
        body = await request.body()
    except ClientDisconnect:
        state.metrics.client_gone.labels(where="body").inc()
        return Response(status_code=499)
    api_key = request.scope.get(API_KEY_SCOPE)
    if len(body) <= _INLINE_PEEK_BYTES:
        peek = peek_admission(body)
    else:  # a big body takes a while to parse: off the event loop
        peek = await state.in_thread(peek_admission, body)
    if peek.n > MAX_N:
        raise APIError(f"n={peek.n} choices, at most {MAX_N} in one request", param="n")
    num_choices = peek.n
    if num_choices > 1 and (widen := request.scope.get(WIDEN_SCOPE)) is not None:
        try:
            widen(num_choices)  # the key's requests in flight: n
        except APIError as e:
            return e.response()
    priority = state.checks.priority_for(peek.priority, api_key)
    try:
        ticket: AdmissionTicket | None = await state.admit(
            request, timeout_s, num_choices, priority
        )
    except ClientGone:
        return Response(status_code=499)
    try:
        prep = await state.in_thread(prepare, state.checks, body, api_key)
        assert prep.n <= num_choices, (prep.n, num_choices)
        if (budget := request.scope.get(TOKEN_BUDGET_SCOPE)) is not None:
            # the key's tokens per minute bound what the request may produce, not only its start
            allowed = budget(len(prep.prompt_ids), prep.n, prep.params.max_tokens)
            if allowed < prep.params.max_tokens:
                prep = prep._replace(params=replace(prep.params, max_tokens=allowed))
        # per-key tokens per minute
        choices = state.new_choices(prefix, prep, request.scope.get(TOKEN_METER_SCOPE))
        render = make_renderer(state.model_name, choices)
        if prep.stream:
            steps = sse_steps(
                choices,
                render.chunk,
                render.usage if prep.include_usage else None,
                render.first(),
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
        if (gone := await state.run(request, choices, deadline)) is not None:
            return gone
        # built and serialized in a parse thread: n choices of many tokens, each with its
        # top_logprobs, are seconds of work the event loop must not do
        body_out = await state.in_thread(_final_json, render)
        return Response(body_out, media_type="application/json")
    finally:
        if ticket is not None:
            ticket.release()
