"""Operating a cluster over HTTP (``pd scale`` and ``pd status`` use these):

- ``GET /admin/nodes``: every node (id, role, Ray node, state ``starting|ready|draining``, load,
  KV usage, cached tokens, pulls, what it holds open), the pools' targets, the autoscaler's last
  decisions and the coordinator's last pull-or-compute choices (``pulls``);
- ``POST /admin/scale {"prefill": N, "decode": M}`` (either may be left out): set the pools'
  target sizes (prefill may be 0: the decode nodes then prefill every prompt, decode at
  least 1); nodes start, or drain and leave, in the background (202); a pool grown past
  what the Ray cluster can hold is refused (409, with the numbers: ``pd.fleet.placement``);
- ``POST /admin/nodes/{id}/drain``: no new requests for it, the ones it has finish, then it
  leaves (its pool's target drops by one; 409 for the last decode node);
- ``POST /admin/warmup {"prompts": [...], "cache_salt": ...}``: prefill each prompt (text or
  token ids) into the cache of the prefill node the coordinator routes it to (a decode node
  when the prefill pool is empty), generating nothing; the answer says where each went;
- ``GET /admin/routes?request_id=ID``: where each attempt of a recent request went (its
  prefill node or none, its decode node, the prefix expected there, a pull), ID being the
  ``id`` of its response (``pd.router.route_log``).

The router is included by ``build_app`` when it is given a ``ClusterAdmin`` (``app.state.admin``)
and needs an admin key when the server has keys (``AuthMiddleware``: 401 without a key, 403
with a tenant's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from pd.server.checks import RequestChecks
from pd.server.http.auth import API_KEY_SCOPE
from pd.server.http.errors import APIError
from pd.server.routes.common import server_state

if TYPE_CHECKING:  # the colocated server never imports the cluster (nor Ray)
    from pd.fleet.admin import ClusterAdmin

router = APIRouter(prefix="/admin")
MAX_WARMUP_PROMPTS = 256


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prefill: int | None = Field(default=None, ge=0, le=1024)  # 0: decode nodes prefill
    decode: int | None = Field(default=None, ge=1, le=1024)


class WarmupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompts: list[str | list[int]] = Field(min_length=1, max_length=MAX_WARMUP_PROMPTS)
    cache_salt: str | None = Field(default=None, min_length=1)  # as a request's
    key_group: str | None = Field(default=None, min_length=1)  # warm that group's cache


def _admin(request: Request) -> ClusterAdmin:
    return request.app.state.admin


def _pools(admin: ClusterAdmin) -> dict[str, Any]:
    auto = admin.autoscaler
    return {
        "target": admin.target()._asdict(),
        "nodes": [v._asdict() for v in admin.nodes()],
        "autoscaler": None
        if auto is None
        else {pool: d._asdict() for pool, d in auto.last.items()} | {"config": vars(auto.cfg)},
        "pulls": admin.pulls(),
    }


@router.get("/nodes")
async def nodes(request: Request) -> dict[str, Any]:
    return _pools(_admin(request))


@router.get("/routes")
async def routes(request_id: str, request: Request) -> dict[str, Any]:
    return {"request_id": request_id, "attempts": _admin(request).routes(request_id)}


@router.post("/scale")
async def scale(body: ScaleRequest, request: Request) -> JSONResponse:
    admin = _admin(request)
    if body.prefill is None and body.decode is None:
        raise HTTPException(400, "give prefill and/or decode: the pools' target sizes")
    refusal = await run_in_threadpool(admin.check_capacity, body.prefill, body.decode)  # asks Ray
    if refusal is not None:
        raise APIError(
            refusal.message, status_code=409, param=refusal.role, code="insufficient_capacity"
        )
    admin.scale(body.prefill, body.decode)
    return JSONResponse(_pools(admin), status_code=202)


@router.post("/nodes/{node_id}/drain")
async def drain(node_id: str, request: Request) -> JSONResponse:
    admin = _admin(request)
    try:
        admin.drain(node_id)
    except KeyError:
        raise HTTPException(404, f"no ready node {node_id!r}") from None
    except ValueError as e:
        raise HTTPException(409, str(e)) from None
    return JSONResponse(_pools(admin), status_code=202)


def _warmup_prompts(checks: RequestChecks, body: WarmupRequest) -> list[list[int]]:
    """Token ids of each prompt, checked like a request's (4xx with the prompt's index)."""
    prompts: list[list[int]] = []
    for i, prompt in enumerate(body.prompts):
        param = f"prompts[{i}]"
        if isinstance(prompt, str):
            ids = checks.encode(prompt, param)
        else:
            ids = checks.prompt_ids(prompt, param)
        if not ids:
            raise HTTPException(400, f"{param} is empty")
        checks.max_tokens_for(len(ids), 1, param)  # it must leave room for its one token
        prompts.append(ids)
    return prompts


@router.post("/warmup")
async def warmup(body: WarmupRequest, request: Request) -> dict[str, Any]:
    state = server_state(request)
    if body.key_group is not None:
        namespace = state.checks.group_namespace(body.key_group, body.cache_salt)
    else:
        namespace = state.checks.namespace(request.scope.get(API_KEY_SCOPE), body.cache_salt)
    prompts = await state.in_thread(_warmup_prompts, state.checks, body)  # tokenizing takes a while
    results = await _admin(request).warmup(prompts, namespace)
    return {
        "prompts": [
            {"node": r.node_id, "num_tokens": r.num_tokens, "cached_tokens": r.num_cached_tokens}
            for r in results
        ]
    }
