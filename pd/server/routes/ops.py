"""Operations: ``/health`` (liveness) and ``/ready`` (readiness), open to all, for load
balancers and probes; ``/metrics`` (an admin's, or open with ``--metrics-no-auth``) and
``/v1/models``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from pd.core.outputs import ClusterStats
from pd.server.http.auth import ROLE_SCOPE, Role
from pd.server.openai.responses import ModelCard, ModelList
from pd.server.routes.common import server_state

logger = logging.getLogger(__name__)

# called on the event loop: each answers from what it holds, without waiting on anything
StatsFn = Callable[[], ClusterStats]
HealthFn = Callable[[], Mapping[str, Any]]

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request) -> ModelList:
    state = server_state(request)
    return ModelList(data=[ModelCard(id=state.model_name, max_model_len=state.max_model_len)])


@router.get("/health")
async def health() -> JSONResponse:
    """Liveness: 200 while the process serves HTTP, whatever the nodes do (a probe restarts a
    process that stops answering; it must not restart one whose pool is being replaced)."""
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 while every pool has a live, ready node; else 503 saying which has none.
    An admin key (or an open API) also gets ``extra_health()``'s keys (the node list)."""
    state = server_state(request)
    try:
        reason = await state.client.readiness()
    except Exception as e:
        logger.exception("readiness() failed")
        reason = f"readiness check failed: {e!r}"
    if state.is_shutting_down:  # SIGTERM: out of rotation while what is in flight finishes
        reason = "the server is shutting down"
    body: dict[str, Any] = {"status": "ready"}
    if reason is not None:
        body = {"status": "unavailable", "reason": reason}
    extra_health: HealthFn | None = request.app.state.extra_health
    if extra_health is not None and request.scope.get(ROLE_SCOPE) is Role.ADMIN:
        try:
            body.update(extra_health())
        except Exception as e:
            logger.exception("extra_health() failed")
            body["extra_health_error"] = repr(e)
    return JSONResponse(body, status_code=200 if reason is None else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = server_state(request)
    stats_fn: StatsFn | None = request.app.state.stats_fn
    if stats_fn is not None:
        try:
            state.metrics.update_stats(stats_fn())
        except Exception:  # a scrape must not fail because one node is slow to answer
            logger.exception("stats_fn() failed")
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
