"""The admin endpoints over a scripted cluster: behind an admin key (a tenant's is refused),
requests checked like any other (4xx naming the field), a pool grown past what the cluster can
place refused with the numbers, warm-up prompts tokenized and namespaced as requests are; and
``pd scale`` / ``pd status`` against them. The live clusters behind them are
tests/fleet/test_operate.py and tests/fleet/test_admin_live.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from pd.cache.tenants import group_namespace
from pd.cli import main as pd_main
from pd.cluster.client import WarmResult
from pd.fleet.admin import CapacityRefusal, NodeView, PoolSizes
from pd.model.tokenizer import encode_prompt
from pd.router.coordinator import Route
from pd.router.pulls import Pull
from pd.router.route_log import RouteLog
from pd.server import ServerConfig, ServerMetrics, build_app
from pd.server.http.auth import cache_namespace
from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, serve
from tests.server.fake_engine import FakeEngineClient

pytestmark = pytest.mark.timeout(60)
KEY = "admin-key-0123456789"
TENANT_KEY = "tenant-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
CALLS = [
    ("GET", "/admin/nodes", None),
    ("POST", "/admin/scale", {"prefill": 2}),
    ("POST", "/admin/nodes/prefill-1/drain", None),
    ("POST", "/admin/warmup", {"prompts": ["You are a helpful assistant."]}),
    ("GET", "/admin/routes?request_id=cmpl-1", None),
]


class FakeAdmin:
    """A cluster whose pools take any size at once."""

    autoscaler = None

    def __init__(self, max_nodes: int = 8) -> None:
        self.sizes = {"prefill": 1, "decode": 1}
        self.max_nodes = max_nodes  # both pools together
        self.warmed: list[tuple[list[list[int]], str]] = []

    def check_capacity(
        self, prefill: int | None = None, decode: int | None = None
    ) -> CapacityRefusal | None:
        for role, n in (("prefill", prefill), ("decode", decode)):
            other = self.sizes["decode" if role == "prefill" else "prefill"]
            if n is not None and n + other > self.max_nodes:
                limit = self.max_nodes - other
                return CapacityRefusal(
                    role, f"asked for {n} {role} nodes, the cluster can place at most {limit}"
                )
        return None

    def target(self) -> PoolSizes:
        return PoolSizes(**self.sizes)

    def pulls(self) -> dict:
        return {"num_pulls": 0, "num_computed": 0, "num_fallbacks": 0, "decisions": []}

    def nodes(self) -> list[NodeView]:
        return [
            NodeView(
                *(f"{role}-{i}", role, "ray-1", "ready", 2, 30, 0.25, 100, 400, 64, 3, 10, 1, 12),
                sockets=5,
                pid=4000 + i,
                addr=f"tcp://127.0.0.1:{5000 + i}",
                transfer_addr=f"tcp://127.0.0.1:{6000 + i}",
            )
            for role, n in self.sizes.items()
            for i in range(n)
        ]

    def scale(self, prefill: int | None = None, decode: int | None = None) -> PoolSizes:
        pairs = (("prefill", prefill), ("decode", decode))
        self.sizes.update({k: v for k, v in pairs if v is not None})
        return self.target()

    def drain(self, node_id: str) -> PoolSizes:
        role = node_id.split("-")[0]
        if node_id not in {n.id for n in self.nodes()}:
            raise KeyError(node_id)
        if self.sizes[role] == 1:
            raise ValueError(f"{node_id} is the last {role} node: the pool keeps 1")
        self.sizes[role] -= 1
        return self.target()

    def routes(self, request_id: str) -> list[dict[str, Any]]:
        log = RouteLog()
        log.add("cmpl-1", Route(None, "decode-0", 40))
        log.add("cmpl-1~1", Route("prefill-1", "decode-0", 0, Pull("prefill-0", 64, 2.0)))
        log.add("cmpl-10", Route(None, "decode-0", 0))
        return [r._asdict() for r in log.of(request_id)]

    async def warmup(self, prompts: Sequence[list[int]], namespace: str) -> list[WarmResult]:
        self.warmed.append(([list(p) for p in prompts], namespace))
        return [WarmResult(f"prefill-{i % 2}", len(p), 0) for i, p in enumerate(prompts)]


def _app(tokenizer: Any, admin: FakeAdmin, **config: Any) -> Any:
    config = {"api_key": (TENANT_KEY,), "admin_api_key": (KEY,), **config}
    return build_app(
        FakeEngineClient(output_ids=[5, 6], eos_token_id=tokenizer.eos_token_id),
        tokenizer=tokenizer,
        model_name=MODEL_NAME,
        max_model_len=MAX_MODEL_LEN,
        config=ServerConfig(**config),
        metrics=ServerMetrics(),
        admin=admin,  # type: ignore[arg-type]
        extra_health=lambda: {"nodes": [n.id for n in admin.nodes()]},
    )


def test_every_admin_endpoint_needs_an_admin_key(tokenizer) -> None:
    """No key: 401; a tenant's: 403 (on an unknown admin path too, before routing); an
    admin's: served. Only an admin sees the node list on /ready."""
    admin = FakeAdmin()
    tenant = {"Authorization": f"Bearer {TENANT_KEY}"}
    with serve(_app(tokenizer, admin)) as url, httpx.Client(base_url=url, timeout=10) as c:
        for method, path, body in [*CALLS, ("GET", "/admin/nothing", None)]:
            assert c.request(method, path, json=body).status_code == 401, path
            r = c.request(method, path, json=body, headers=tenant)
            assert r.status_code == 403, (path, r.text)
            assert r.json()["error"]["code"] == "admin_key_required"
            assert r.json()["error"]["type"] == "permission_error"
        assert admin.sizes == {"prefill": 1, "decode": 1} and not admin.warmed
        got = [c.request(m, p, json=b, headers=AUTH).status_code for m, p, b in CALLS]
        assert c.get("/admin/nothing", headers=AUTH).status_code == 404
        assert c.get("/ready").json() == {"status": "ready"}
        assert c.get("/ready", headers=tenant).json() == {"status": "ready"}
        assert c.get("/ready", headers=AUTH).json()["nodes"] == ["prefill-0", "decode-0"]
        assert c.get("/health", headers=AUTH).json() == {"status": "ok"}  # never node ids
    assert got == [200, 202, 202, 200, 200]
    assert admin.sizes == {"prefill": 1, "decode": 1}  # scaled to 2, then one drained


def test_routes_say_where_each_attempt_of_a_request_went(tokenizer) -> None:
    with serve(_app(tokenizer, FakeAdmin())) as url, httpx.Client(base_url=url, timeout=10) as c:
        body = c.get("/admin/routes", params={"request_id": "cmpl-1"}, headers=AUTH).json()
        assert c.get("/admin/routes", headers=AUTH).status_code == 400  # no request_id
    assert body["request_id"] == "cmpl-1"
    first, second = body["attempts"]  # cmpl-10 is another request
    assert (first["request_id"], first["prefill"], first["decode"], first["num_matched"]) == (
        "cmpl-1",
        None,
        "decode-0",
        40,
    )
    assert (second["prefill"], second["pull_from"], second["num_pulled"]) == (
        "prefill-1",
        "prefill-0",
        64,
    )


def test_without_an_admin_key_nobody_may_use_the_admin_api(tokenizer) -> None:
    """Tenant keys but no admin key: the admin routes are refused for everyone (and say how
    to open them); no key at all: the API is open, admin routes too."""
    admin = FakeAdmin()
    tenant = {"Authorization": f"Bearer {TENANT_KEY}"}
    app = _app(tokenizer, admin, admin_api_key=())
    with serve(app) as url, httpx.Client(base_url=url, timeout=10) as c:
        for method, path, body in CALLS:
            r = c.request(method, path, json=body, headers=tenant)
            assert r.status_code == 403 and "--admin-api-key" in r.json()["error"]["message"]
        assert c.post("/v1/completions", json={"prompt": "a"}, headers=tenant).status_code == 200
    assert admin.sizes == {"prefill": 1, "decode": 1} and not admin.warmed
    app = _app(tokenizer, admin, api_key=(), admin_api_key=())
    with serve(app) as url, httpx.Client(base_url=url, timeout=10) as c:
        assert c.get("/admin/nodes").status_code == 200
        assert c.get("/ready").json()["nodes"] == ["prefill-0", "decode-0"]


def test_scale_and_drain_answer_with_the_pools_and_refuse_what_cannot_be(tokenizer) -> None:
    admin = FakeAdmin()
    with serve(_app(tokenizer, admin)) as url, httpx.Client(base_url=url, timeout=10) as c:
        r = c.post("/admin/scale", json={"prefill": 3, "decode": 2}, headers=AUTH)
        assert r.status_code == 202
        body = r.json()
        assert body["target"] == {"prefill": 3, "decode": 2} and body["autoscaler"] is None
        assert [n["id"] for n in body["nodes"]] == [
            "prefill-0", "prefill-1", "prefill-2", "decode-0", "decode-1",
        ]  # fmt: skip
        assert body["nodes"][0] == {
            "id": "prefill-0", "role": "prefill", "ray_node": "ray-1", "state": "ready",
            "load": 2, "queued_tokens": 30, "kv_usage": 0.25, "cached_tokens": 100,
            "host_cached_tokens": 400, "pulled_tokens": 64, "pulls_served": 3, "slots_in_use": 10,
            "pair_groups": 1, "threads": 12, "sockets": 5,
            "pid": 4000, "addr": "tcp://127.0.0.1:5000", "transfer_addr": "tcp://127.0.0.1:6000",
        }  # fmt: skip
        r = c.post("/admin/scale", json={"prefill": 1024}, headers=AUTH)
        assert r.status_code == 409, r.text
        assert r.json()["error"] == {
            "message": "asked for 1024 prefill nodes, the cluster can place at most 6",
            "type": "invalid_request_error", "param": "prefill", "code": "insufficient_capacity",
        }  # fmt: skip
        bad_bodies = ({}, None), ({"prefill": -1}, "prefill"), ({"decode": 0}, "decode"), (
            {"decode": 2, "x": 1}, "x",
        )  # fmt: skip
        for bad, field in bad_bodies:
            r = c.post("/admin/scale", json=bad, headers=AUTH)
            assert r.status_code == 400, (bad, r.text)
            assert field is None or field in r.json()["error"]["message"], r.text
        r = c.post("/admin/nodes/decode-7/drain", headers=AUTH)
        assert r.status_code == 404 and "decode-7" in r.json()["error"]["message"]
        assert c.post("/admin/nodes/decode-1/drain", headers=AUTH).status_code == 202
        r = c.post("/admin/nodes/decode-0/drain", headers=AUTH)
        assert r.status_code == 409 and "last decode node" in r.json()["error"]["message"]
        assert admin.sizes == {"prefill": 3, "decode": 1}
        # no prefill pool: the decode nodes prefill every prompt
        assert c.post("/admin/scale", json={"prefill": 0}, headers=AUTH).status_code == 202
    assert admin.sizes == {"prefill": 0, "decode": 1}


def test_warmup_tokenizes_checks_and_namespaces_prompts_as_requests_are(tokenizer) -> None:
    text, ids = "You are a helpful assistant. Answer briefly.", [11, 22, 33, 44]
    for isolate in (False, True):
        admin = FakeAdmin()
        app = _app(tokenizer, admin, isolate_cache_per_key=isolate)
        with serve(app) as url, httpx.Client(base_url=url, timeout=10) as c:
            body = {"prompts": [text, ids], "cache_salt": "team-a"}
            r = c.post("/admin/warmup", json=body, headers=AUTH)
            assert r.status_code == 200, r.text
            assert r.json()["prompts"] == [
                {"node": "prefill-0", "num_tokens": len(encode_prompt(tokenizer, text)),
                 "cached_tokens": 0},
                {"node": "prefill-1", "num_tokens": 4, "cached_tokens": 0},
            ]  # fmt: skip
            too_long = [1] * MAX_MODEL_LEN
            for bad, where in (
                ({"prompts": [ids, too_long]}, "prompts[1]"),
                ({"prompts": [[1, 10**9]]}, "prompts[0]"),
                ({"prompts": [""]}, "prompts[0]"),
                ({"prompts": []}, "prompts"),
                ({"prompts": [ids], "cache_salt": ""}, "cache_salt"),
            ):
                r = c.post("/admin/warmup", json=bad, headers=AUTH)
                assert r.status_code == 400 and where in r.text, (bad, r.text)
        (prompts, namespace), = admin.warmed  # fmt: skip
        assert prompts == [encode_prompt(tokenizer, text), ids]
        assert namespace == cache_namespace(KEY if isolate else None, "team-a")


def test_warmup_of_a_key_group_warms_the_namespace_its_keys_get(tokenizer) -> None:
    """``"key_group"``: the group's namespace, the one its keys' requests get; an unknown group
    (or isolation off) is a 400 naming it."""
    admin = FakeAdmin()
    app = _app(tokenizer, admin, key_groups=((TENANT_KEY, "team-a"),))
    with serve(app) as url, httpx.Client(base_url=url, timeout=10) as c:
        body = {"prompts": [[11, 22, 33]], "key_group": "team-a"}
        assert c.post("/admin/warmup", json=body, headers=AUTH).status_code == 200
        r = c.post("/admin/warmup", json={**body, "key_group": "team-b"}, headers=AUTH)
        assert r.status_code == 400, r.text
        assert "key_group 'team-b' is not one of this server's 1 key groups" in r.text
    (_, namespace), = admin.warmed  # fmt: skip
    assert namespace == cache_namespace(TENANT_KEY, None, "team-a") == group_namespace("team-a")


def test_pd_scale_and_pd_status_talk_to_the_server(tokenizer, capsys, monkeypatch) -> None:
    admin = FakeAdmin()
    with serve(_app(tokenizer, admin)) as url:
        assert pd_main(["scale", "--url", url, "--api-key", KEY, "--prefill", "2"]) == 0
        out = capsys.readouterr().out
        assert admin.sizes == {"prefill": 2, "decode": 1}
        assert out.startswith("target: prefill 2, decode 1\nid ")
        assert len(out.strip().splitlines()) == 2 + 3
        monkeypatch.setenv("PD_ADMIN_API_KEY", KEY)  # the key pd serve reads is theirs too
        monkeypatch.setenv("PD_API_KEY", TENANT_KEY)
        assert pd_main(["status", "--url", url]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[2].split() == [
            "prefill-0", "prefill", "ready", "ray-1", "2", "30", "0.25", "100", "400", "64", "3",
        ]  # fmt: skip
        monkeypatch.delenv("PD_ADMIN_API_KEY")
        assert pd_main(["status", "--url", url]) == 1  # PD_API_KEY's tenant key: refused
        assert "HTTP 403: /admin/nodes needs an admin API key" in capsys.readouterr().err
        monkeypatch.delenv("PD_API_KEY")
        assert pd_main(["status", "--url", url, "--api-key", "wrong"]) == 1
        assert "HTTP 401" in capsys.readouterr().err
        assert pd_main(["scale", "--url", url, "--api-key", KEY, "--decode", "99"]) == 1
        assert "HTTP 409: asked for 99 decode nodes" in capsys.readouterr().err
        assert pd_main(["scale", "--url", url, "--api-key", KEY]) == 2  # no size given
    assert pd_main(["status", "--url", url]) == 1  # the server is gone
    assert "cannot reach the pd server" in capsys.readouterr().err
