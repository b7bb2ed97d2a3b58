"""Operations: ``/health`` and ``/ready`` (open to all), ``/metrics`` and ``/v1/models``."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from pd.outputs import ClusterStats
from pd.server.responses import ModelCard, ModelList
from pd.server.routes.common import server_state

logger = logging.getLogger(__name__)

T = TypeVar("T")
MaybeAwaitable = T | Awaitable[T]
StatsFn = Callable[[], MaybeAwaitable[ClusterStats]]
HealthFn = Callable[[], MaybeAwaitable[Mapping[str, Any]]]

router = APIRouter()


async def _maybe_await(value: MaybeAwaitable[T]) -> T:
    return await value if inspect.isawaitable(value) else value  # type: ignore[return-value]


@router.get("/v1/models")
async def models(request: Request) -> ModelList:
    state = server_state(request)
    return ModelList(data=[ModelCard(id=state.model_name, max_model_len=state.max_model_len)])


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = server_state(request)
    try:
        ready = bool(await state.client.is_ready())
    except Exception:
        logger.exception("is_ready() failed")
        ready = False
    body: dict[str, Any] = {"status": "ok" if ready else "unavailable"}
    extra_health: HealthFn | None = request.app.state.extra_health
    if extra_health is not None:
        try:
            body.update(await _maybe_await(extra_health()))
        except Exception as e:
            logger.exception("extra_health() failed")
            body["extra_health_error"] = repr(e)
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 while every pool has a live, ready node; else 503 saying which has none
    (``/health`` stays 200 while a replacement starts: requests wait for it)."""
    client = server_state(request).client
    try:
        reason = await client.readiness()
    except Exception as e:
        logger.exception("readiness() failed")
        reason = f"readiness check failed: {e!r}"
    if reason is None:
        return JSONResponse({"status": "ready"})
    return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = server_state(request)
    stats_fn: StatsFn | None = request.app.state.stats_fn
    if stats_fn is not None:
        try:
            state.metrics.update_stats(await _maybe_await(stats_fn()))
        except Exception:  # a scrape must not fail because one node is slow to answer
            logger.exception("stats_fn() failed")
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
