"""The OpenAI-compatible HTTP server over any ``EngineClient``.

Every request is validated, templated and tokenized here before the engine sees it: a bad
request is answered 4xx in OpenAI's error shape and nothing is queued. Streams are SSE
(``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``); a client that goes away cancels its stream
or its waiting handler, and the request is aborted on the engine.
"""

from __future__ import annotations

import inspect
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from pd.model.tokenizer import encode_chat, encode_prompt
from pd.outputs import ClusterStats, EngineClient
from pd.sampling_params import SamplingParams
from pd.server.generation import Generation
from pd.server.metrics import ServerMetrics
from pd.server.protocol import (
    APIError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    GenerateRequest,
    GenerateResponse,
    ModelCard,
    ModelList,
    Usage,
    make_sampling_params,
)
from pd.server.routes import admin as admin_routes
from pd.server.streaming import ClientGone, cancel_on_disconnect, sse_response, sse_steps

if TYPE_CHECKING:
    from pd.cluster.admin import ClusterAdmin

logger = logging.getLogger(__name__)

T = TypeVar("T")
MaybeAwaitable = T | Awaitable[T]
StatsFn = Callable[[], MaybeAwaitable[ClusterStats]]
HealthFn = Callable[[], MaybeAwaitable[Mapping[str, Any]]]


async def _maybe_await(value: MaybeAwaitable[T]) -> T:
    return await value if inspect.isawaitable(value) else value  # type: ignore[return-value]


class _Server:
    """The request handlers' shared state and the steps common to every endpoint."""

    def __init__(
        self,
        client: EngineClient,
        tokenizer: Any,
        model_name: str,
        max_model_len: int,
        metrics: ServerMetrics,
    ) -> None:
        assert max_model_len >= 2, f"max_model_len must be >= 2, got {max_model_len}"
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.vocab_size = len(tokenizer)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                status_code=404,
                param="model",
                code="model_not_found",
            )

    def check_ids(self, ids: list[int], param: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise APIError(
                f"token ids must be in [0, {self.vocab_size}), got {bad[:5]}", param=param
            )

    def namespace(self, api_key: str | None, cache_salt: str | None) -> str:
        """The prefix-cache namespace of a request: the shared one (no per-request namespaces
        here yet)."""
        if cache_salt is not None:
            raise APIError("cache_salt is not supported by this server", param="cache_salt")
        return ""

    def encode(self, text: str, param: str) -> list[int]:
        if not text:
            raise APIError(f"{param} must not be empty", param=param)
        return encode_prompt(self.tokenizer, text)

    def apply_chat_template(self, req: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text} for m in req.messages]
        try:
            return encode_chat(self.tokenizer, messages)
        except Exception as e:  # no template, or the template rejects the conversation
            raise APIError(f"cannot apply the chat template: {e}", param="messages") from e

    def max_tokens_for(self, num_prompt_tokens: int, requested: int | None, param: str) -> int:
        """The completion budget; 400 when the prompt and the request do not fit the context."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise APIError(
                f"The prompt has {num_prompt_tokens} tokens, but this model's maximum context "
                f"length is {limit} tokens and at least one must be left for the completion.",
                param=param,
                code="context_length_exceeded",
            )
        if requested is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + requested > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, "
                f"{requested} for the completion). Reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    def new_generation(
        self, prefix: str, prompt_ids: list[int], params: SamplingParams
    ) -> Generation:
        self.check_ids(list(params.stop_token_ids), "stop_token_ids")
        return Generation(
            client=self.client,
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            prompt_ids=prompt_ids,
            params=params,
            tokenizer=self.tokenizer,
            metrics=self.metrics,
        )

    async def run(self, request: Request, gen: Generation) -> Response | None:
        """Run a non-streaming request; a Response only when there is nothing to answer with."""
        try:
            await cancel_on_disconnect(request, gen.run())
        except ClientGone:
            return Response(status_code=499)
        except ValueError as e:  # the engine refused the request (e.g. larger than its KV pool)
            raise APIError(str(e), status_code=400) from e
        except Exception as e:
            logger.exception("request %s failed", gen.request_id)
            raise APIError(f"internal error: {e!r}", status_code=500, type="server_error") from e
        return None

    def usage(self, gen: Generation) -> Usage:
        return Usage.make(gen.num_prompt_tokens, len(gen.output_ids), gen.num_cached_tokens)


def _validation_error(exc: RequestValidationError) -> APIError:
    """One 400 naming each bad field once (a union type reports one error per branch)."""
    by_field: dict[str, str] = {}
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return APIError(f"invalid JSON body: {err.get('msg')}")
        if not loc:
            return APIError(f"the request body must be a JSON object: {err.get('msg')}")
        got = repr(err.get("input"))
        got = got if len(got) <= 60 else got[:57] + "..."
        by_field.setdefault(loc[0], f"{loc[0]}: {err.get('msg')} (got {got})")
    return APIError("; ".join(by_field.values()), param=next(iter(by_field), None))


def build_app(
    client: EngineClient,
    *,
    tokenizer: Any,
    model_name: str,
    max_model_len: int,
    metrics: ServerMetrics | None = None,
    extra_health: HealthFn | None = None,
    stats_fn: StatsFn | None = None,
    admin: ClusterAdmin | None = None,
) -> FastAPI:
    """The HTTP app. ``extra_health()`` adds keys to GET /health's body; ``stats_fn()`` fills
    the cluster gauges on each GET /metrics (a ``ClusterStats``). Either may be
    sync or async. ``admin``: serve the admin endpoints (``pd.server.routes.admin``)."""
    server = _Server(client, tokenizer, model_name, max_model_len, metrics or ServerMetrics())
    app = FastAPI(title="pd", version="0.1.0")
    app.state.server = server
    if admin is not None:
        app.state.admin = admin
        app.include_router(admin_routes.router)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.to_dict(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = _validation_error(exc)
        return JSONResponse(err.to_dict(), status_code=err.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(str(exc.detail), status_code=exc.status_code)
        return JSONResponse(err.to_dict(), status_code=exc.status_code, headers=exc.headers)

    @app.post("/v1/completions", response_model=None)
    async def completions(
        req: CompletionRequest, request: Request
    ) -> Response | CompletionResponse:
        req.check_supported()
        server.check_model(req.model)
        prompt = req.single_prompt
        if isinstance(prompt, str):
            prompt_ids = server.encode(prompt, "prompt")
        else:
            server.check_ids(prompt, "prompt")
            prompt_ids = list(prompt)
        max_tokens = server.max_tokens_for(len(prompt_ids), req.max_tokens, "prompt")
        gen = server.new_generation("cmpl", prompt_ids, req.to_sampling_params(max_tokens))

        def chunk(text: str, ids: list[int], finish_reason: str | None) -> BaseModel | None:
            if not text and finish_reason is None:
                return None
            choice = CompletionChoice(text=text, finish_reason=finish_reason)
            return CompletionResponse(id=gen.request_id, model=model_name, choices=[choice])

        def usage() -> BaseModel:
            return CompletionResponse(
                id=gen.request_id, model=model_name, choices=[], usage=server.usage(gen)
            )

        if req.stream:
            return sse_response(sse_steps(gen, chunk, usage if req.include_usage else None))
        if (gone := await server.run(request, gen)) is not None:
            return gone
        choice = CompletionChoice(text=gen.text, finish_reason=gen.finish_reason)
        return CompletionResponse(
            id=gen.request_id, model=model_name, choices=[choice], usage=server.usage(gen)
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(
        req: ChatCompletionRequest, request: Request
    ) -> Response | ChatCompletionResponse:
        req.check_supported()
        server.check_model(req.model)
        prompt_ids = server.apply_chat_template(req)
        max_tokens = server.max_tokens_for(len(prompt_ids), req.requested_max_tokens, "messages")
        gen = server.new_generation("chatcmpl", prompt_ids, req.to_sampling_params(max_tokens))

        def chunk(text: str, ids: list[int], finish_reason: str | None) -> BaseModel | None:
            if not text and finish_reason is None:
                return None
            delta = DeltaMessage(content=text) if text else DeltaMessage()
            choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
            return ChatCompletionChunk(id=gen.request_id, model=model_name, choices=[choice])

        def usage() -> BaseModel:
            return ChatCompletionChunk(
                id=gen.request_id, model=model_name, choices=[], usage=server.usage(gen)
            )

        if req.stream:
            role = ChatChunkChoice(delta=DeltaMessage(role="assistant", content=""))
            first = ChatCompletionChunk(id=gen.request_id, model=model_name, choices=[role])
            return sse_response(sse_steps(gen, chunk, usage if req.include_usage else None, first))
        if (gone := await server.run(request, gen)) is not None:
            return gone
        choice = ChatChoice(
            message=ChatMessageOut(content=gen.text), finish_reason=gen.finish_reason
        )
        return ChatCompletionResponse(
            id=gen.request_id, model=model_name, choices=[choice], usage=server.usage(gen)
        )

    @app.post("/generate", response_model=None)
    async def generate(req: GenerateRequest, request: Request) -> Response | GenerateResponse:
        if (req.input_ids is None) == (req.text is None):
            raise APIError("give exactly one of input_ids and text", param="input_ids")
        if req.input_ids is not None:
            if not req.input_ids:
                raise APIError("input_ids must not be empty", param="input_ids")
            server.check_ids(req.input_ids, "input_ids")
            prompt_ids = list(req.input_ids)
        else:
            prompt_ids = server.encode(req.text or "", "text")
        sp = req.sampling_params
        max_tokens = server.max_tokens_for(len(prompt_ids), sp.max_new_tokens, "input_ids")
        stop = (sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop or ())
        params = make_sampling_params(
            max_tokens=max_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            seed=sp.seed,
            stop=stop,
            stop_token_ids=tuple(sp.stop_token_ids or ()),
            ignore_eos=sp.ignore_eos,
            include_stop_str_in_output=sp.include_stop_str_in_output,
        )
        gen = server.new_generation("gen", prompt_ids, params)

        def result(text: str, ids: list[int], finish_reason: str | None) -> GenerateResponse:
            return GenerateResponse(
                id=gen.request_id,
                output_ids=ids,
                text=text,
                finish_reason=finish_reason,
                prompt_tokens=gen.num_prompt_tokens,
                completion_tokens=len(gen.output_ids),
                cached_tokens=gen.num_cached_tokens,
            )

        if req.stream:
            return sse_response(sse_steps(gen, result, None))
        if (gone := await server.run(request, gen)) is not None:
            return gone
        return result(gen.text, gen.output_ids, gen.finish_reason)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=max_model_len)])

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            ready = bool(await client.is_ready())
        except Exception:
            logger.exception("is_ready() failed")
            ready = False
        body: dict[str, Any] = {"status": "ok" if ready else "unavailable"}
        if extra_health is not None:
            try:
                body.update(await _maybe_await(extra_health()))
            except Exception as e:
                logger.exception("extra_health() failed")
                body["extra_health_error"] = repr(e)
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        if stats_fn is not None:
            try:
                server.metrics.update_stats(await _maybe_await(stats_fn()))
            except Exception:  # a scrape must not fail because one node is slow to answer
                logger.exception("stats_fn() failed")
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
