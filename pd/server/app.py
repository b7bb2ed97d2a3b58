"""The OpenAI-compatible HTTP server over any ``EngineClient``: the app factory.

``build_app`` holds the shared state (``app.state.server``, a ``ServerState``), the error
handlers and the middleware; the endpoints live in ``pd.server.routes`` by family. Every
request is authenticated, admitted, validated, templated and tokenized here before the engine
sees it: a bad request is answered 4xx in OpenAI's error shape and nothing is queued. Streams
are SSE (``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``); a client that goes away cancels its
stream or its waiting handler, and the request is aborted on the engine. Every wait on a
client is bounded: its body (408), its place in the admission queue (it leaves when the client
does), and each write of its response (a client that reads nothing is cut off).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp

from pd.core.outputs import EngineClient
from pd.server.config import ServerConfig
from pd.server.http.auth import ApiKeys
from pd.server.http.errors import APIError, validation_error
from pd.server.http.key_limits import KeyLimiter, KeyLimitMiddleware
from pd.server.http.middleware import (
    AuthMiddleware,
    BodyLimitMiddleware,
    BodyRefused,
    CatchAllMiddleware,
    WriteTimeoutMiddleware,
)
from pd.server.metrics import ServerMetrics
from pd.server.openai.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from pd.server.routes import ROUTERS
from pd.server.routes import admin as admin_routes
from pd.server.routes.ops import HealthFn, StatsFn
from pd.server.state import ServerState

if TYPE_CHECKING:  # the colocated server never imports the cluster (nor Ray)
    from pd.fleet.admin import ClusterAdmin

# Bodies the handlers parse themselves (off the event loop); their schemas are added to the
# OpenAPI document by hand.
_REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest,
    ChatCompletionRequest,
    GenerateRequest,
)


class _App(FastAPI):
    """FastAPI with ``WriteTimeoutMiddleware`` outside Starlette's own middleware (where
    ``add_middleware`` cannot put it): it needs the server's own ``send``."""

    def build_middleware_stack(self) -> ASGIApp:
        state: ServerState = self.state.server
        timeout_s = state.config.stream_write_timeout_s
        return WriteTimeoutMiddleware(super().build_middleware_stack(), timeout_s, state.metrics)


def build_app(
    client: EngineClient,
    *,
    tokenizer: Any,
    model_name: str,
    max_model_len: int,
    config: ServerConfig | None = None,
    metrics: ServerMetrics | None = None,
    extra_health: HealthFn | None = None,
    stats_fn: StatsFn | None = None,
    admin: ClusterAdmin | None = None,
) -> FastAPI:
    """The HTTP app. ``extra_health()`` adds keys to GET /ready's body for an admin (the node
    list: never shown to a tenant or a probe without a key); ``stats_fn()`` fills
    the cluster gauges on each GET /metrics (a ``ClusterStats``). Both are plain functions,
    called on the event loop. ``admin``: serve the admin endpoints (``pd.server.routes.admin``)."""
    config = config or ServerConfig()
    metrics = metrics or ServerMetrics()
    app = _App(title="pd", version="0.1.0")
    app.state.server = ServerState(client, tokenizer, model_name, max_model_len, metrics, config)
    app.state.extra_health = extra_health
    app.state.stats_fn = stats_fn
    for router in ROUTERS:
        app.include_router(router)
    if admin is not None:
        app.state.admin = admin
        app.include_router(admin_routes.router)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc, BodyRefused):
            return exc.error.response()
        headers = dict(exc.headers or {})
        return APIError(str(exc.detail), status_code=exc.status_code, headers=headers).response()

    open_paths = {"/health", "/ready"} | ({"/metrics"} if config.metrics_no_auth else set())
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=config.max_body_bytes,
        read_timeout_s=config.body_read_timeout_s,
        max_bytes_in_flight=config.max_body_bytes_in_flight, metrics=metrics,
    )  # fmt: skip
    limiter = KeyLimiter(config.max_inflight_per_key, config.max_tokens_per_minute_per_key)
    if limiter.is_enabled:
        app.add_middleware(KeyLimitMiddleware, limiter=limiter, metrics=metrics)
    app.state.key_limiter = limiter
    keys = ApiKeys(config.api_key, config.admin_api_key)
    app.add_middleware(AuthMiddleware, keys=keys, open_paths=frozenset(open_paths), metrics=metrics)
    app.add_middleware(CatchAllMiddleware)
    app.openapi = _openapi_with_request_models(app)  # type: ignore[method-assign]
    return app


def _openapi_with_request_models(app: FastAPI) -> Callable[[], dict[str, Any]]:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in _REQUEST_MODELS:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    return openapi
