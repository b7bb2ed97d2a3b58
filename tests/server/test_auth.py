"""API keys on every endpoint but /health and /ready, and the prefix-cache namespace a request gets."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from pd.cache.tenants import group_namespace, tenant_of
from pd.core import envs
from pd.server import ServerConfig
from pd.server.http.auth import cache_namespace
from tests.server.conftest import MODEL_NAME, serve
from tests.server.fake_engine import FakeEngineClient

pytestmark = pytest.mark.timeout(30)

MakeApp = Callable[..., tuple[Any, FakeEngineClient]]
KEYS = ("key-alpha-0123456789", "key-beta-9876543210")
ADMIN_KEY = "key-admin-5555555555"
_MSGS = [{"role": "user", "content": "hi"}]

# (method, path, body) of every route, an unknown one included.
ENDPOINTS: list[tuple[str, str, Any]] = [
    ("POST", "/v1/completions", {"prompt": "a", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": _MSGS, "max_tokens": 2}),
    ("POST", "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2}}),
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
    ("GET", "/openapi.json", None),
    ("GET", "/docs", None),
    ("GET", "/v1/nothing", None),
]
WRONG = [None, "Bearer nope", f"Basic {KEYS[0]}", f"Bearer {KEYS[0]}x", "Bearer", f"{KEYS[0]}"]


def _send(client: httpx.Client, method: str, path: str, body: Any, auth: str | None) -> Any:
    headers = {} if auth is None else {"Authorization": auth}
    return client.request(method, path, json=body, headers=headers)


def test_every_endpoint_but_health_needs_a_right_key(make_app: MakeApp) -> None:
    """Tenant keys reach every endpoint but /metrics (an admin's: per-node labels), 403 there;
    an admin key reaches all; no key or a wrong one is a 401 everywhere but the probes."""
    app, fake = make_app(config=ServerConfig(api_key=KEYS, admin_api_key=(ADMIN_KEY,)))
    with serve(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        for method, path, body in ENDPOINTS:
            for auth in WRONG:
                r = _send(client, method, path, body, auth)
                assert r.status_code == 401, (path, auth, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
                assert r.json()["error"]["code"] == "invalid_api_key"
            for key in (*KEYS, ADMIN_KEY):
                r = _send(client, method, path, body, f"Bearer {key}")
                want = 404 if path == "/v1/nothing" else 200
                if path == "/metrics" and key != ADMIN_KEY:
                    want = 403
                assert r.status_code == want, (path, r.text)
        for path in ("/health", "/ready"):  # probes carry no key
            assert client.get(path).status_code == 200
            assert _send(client, "GET", path, None, "Bearer nope").status_code == 200
        r = _send(client, "GET", "/metrics", None, f"Bearer {KEYS[0]}")
        assert r.json()["error"] == {
            "message": "/metrics needs an admin API key; this key is a tenant's",
            "type": "permission_error", "param": None, "code": "admin_key_required",
        }  # fmt: skip
        text = _send(client, "GET", "/metrics", None, f"bearer {ADMIN_KEY}").text
    assert len(fake.requests) == 9  # 3 generation endpoints x 3 keys; no refused one ran
    unauthorized = len(ENDPOINTS) * len(WRONG)
    assert f'pd_server_rejected_requests_total{{reason="unauthorized"}} {unauthorized}.0' in text
    assert 'pd_server_rejected_requests_total{reason="forbidden"} 3.0' in text


def test_metrics_can_be_left_open_and_no_key_means_open(make_app: MakeApp) -> None:
    app, _ = make_app(config=ServerConfig(api_key=KEYS, metrics_no_auth=True))
    with serve(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        assert client.get("/metrics").status_code == 200
        assert client.get("/v1/models").status_code == 401
    app, _ = make_app()
    with serve(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        assert client.get("/v1/models").status_code == 200
        assert client.post("/v1/completions", json={"prompt": "a"}).status_code == 200


def test_openai_client_sends_its_key(make_app: MakeApp) -> None:
    from openai import AuthenticationError, OpenAI

    app, _ = make_app(config=ServerConfig(api_key=KEYS))
    with serve(app) as url:
        good = OpenAI(base_url=f"{url}/v1", api_key=KEYS[1], max_retries=0, timeout=10)
        done = good.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=3)
        assert done.usage is not None and done.usage.completion_tokens == 3
        bad = OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0, timeout=10)
        with pytest.raises(AuthenticationError, match="invalid API key"):
            bad.chat.completions.create(model=MODEL_NAME, messages=_MSGS)  # type: ignore[arg-type]


def test_api_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from pd.cli import build_parser, server_config

    monkeypatch.setenv("PD_API_KEY", " a1, b2,,c3 ")
    assert envs.PD_API_KEY == ("a1", "b2", "c3")
    args = build_parser().parse_args(["serve", "--api-key", "x9", "--isolate-cache-per-key"])
    cfg = server_config(args)
    assert cfg.api_key == ("x9", "a1", "b2", "c3") and cfg.isolate_cache_per_key
    monkeypatch.setenv("PD_API_KEY", "")
    assert envs.PD_API_KEY == ()
    monkeypatch.setenv("PD_ADMIN_API_KEY", "ad1,ad2")
    args = build_parser().parse_args(["serve", "--admin-api-key", "ad0"])
    assert server_config(args).admin_api_key == ("ad0", "ad1", "ad2")


def test_api_keys_from_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One key a line (commas separate too, blank lines skipped), joining the flags' and the
    environment's; a missing or empty file is an error naming it; a file that group or others
    may read is served, with a warning."""
    from pd.cli import build_parser, server_config

    tenants, admins = tmp_path / "tenants", tmp_path / "admins"
    tenants.write_text("\n  t-file-1\n\nt-file-2,t-file-3\n")
    admins.write_text("ad-file\n")
    for path in (tenants, admins):
        path.chmod(0o600)
    monkeypatch.setenv("PD_API_KEY", "t-env")
    flags = ["--api-key", "t-flag", "--api-key-file", str(tenants)]
    args = build_parser().parse_args(["serve", *flags, "--admin-api-key-file", str(admins)])
    cfg = server_config(args)
    assert cfg.api_key == ("t-flag", "t-file-1", "t-file-2", "t-file-3", "t-env")
    assert cfg.admin_api_key == ("ad-file",)
    assert "chmod 600" not in caplog.text
    tenants.chmod(0o644)
    assert server_config(args).api_key == cfg.api_key
    assert f"--api-key-file {tenants} may be read by group or others (mode 644)" in caplog.text
    (tmp_path / "empty").write_text("\n \n")
    for name, match in (("missing", "No such file or directory"), ("empty", "holds no key")):
        args = build_parser().parse_args(["serve", "--api-key-file", str(tmp_path / name)])
        with pytest.raises(ValueError, match=f"--api-key-file {tmp_path / name}.*{match}"):
            server_config(args)
    (tmp_path / "spaced").write_text("three words here\n")
    args = build_parser().parse_args(["serve", "--admin-api-key-file", str(tmp_path / "spaced")])
    with pytest.raises(ValueError, match="line 1 has 3 fields: KEY or KEY GROUP"):
        server_config(args)


def test_key_groups_from_a_file(tmp_path: Path) -> None:
    """``KEY GROUP`` lines put keys in a group (commas still separate keys); a key in two
    groups, or a group name with a '=', is refused naming the groups."""
    from pd.cli import build_parser, server_config

    keys = tmp_path / "keys"
    keys.write_text("t-alone\nt-a1,t-a2 team-a\n  t-b1   team-b\n")
    keys.chmod(0o600)
    args = build_parser().parse_args(["serve", "--api-key-file", str(keys)])
    cfg = server_config(args)
    assert cfg.api_key == ("t-alone", "t-a1", "t-a2", "t-b1") and cfg.isolate_cache_per_key
    assert cfg.key_group() == {"t-a1": "team-a", "t-a2": "team-a", "t-b1": "team-b"}
    for text, match in (
        ("t-a1 team-a\nt-a1 team-b\n", "in two key groups, 'team-a' and 'team-b'"),
        ("t-a1 team=a\n", "without spaces, '=' or ','"),
    ):
        keys.write_text(text)
        with pytest.raises(ValueError, match=match):
            server_config(args)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"api_key": ("k",), "key_groups": (("x", "g"),)}, "names a key that is not an API"),
        ({"api_key": ("has space",)}, "printable ASCII without spaces"),
        ({"api_key": ("",)}, "non-empty"),
        ({"max_inflight_requests": 0}, "max_inflight_requests must be >= 1, got 0"),
        ({"request_timeout": 0.0}, "request_timeout must be > 0"),
        ({"admin_api_key": ("a,b",)}, "without spaces or commas"),
        ({"max_inflight_per_key": 2}, "max_inflight_per_key needs at least one api_key"),
        ({"api_key": ("k",), "max_tokens_per_minute_per_key": -1}, "must be >= 0"),
    ],
)
def test_server_config_is_validated(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ServerConfig(**kwargs)


def test_cache_namespaces_hide_keys_and_never_collide() -> None:
    a, b = KEYS
    assert cache_namespace(None, None) == ""
    names = {
        (key, salt): cache_namespace(key, salt)
        for key in (None, a, b)
        for salt in (None, "s1", "s2", "")
    }
    del names[(None, None)]
    assert len(set(names.values())) == len(names), "two (key, salt) pairs share a namespace"
    assert all(a not in ns and b not in ns and "s1" not in ns for ns in names.values())
    assert cache_namespace(a, "s1") == cache_namespace(a, "s1")  # stable across restarts
    assert cache_namespace(None, "s1") == cache_namespace(None, "s1")
    # a group's keys share its namespaces, salted ones too; no other key's or group's
    grouped = {cache_namespace(key, salt, "team") for key in (a, b) for salt in (None, "s1")}
    assert len(grouped) == 2 and not grouped & set(names.values())
    assert cache_namespace(a, None, "team") == group_namespace("team")
    assert cache_namespace(a, "s1", "team") != cache_namespace(a, "s1", "team2")
    assert tenant_of(cache_namespace(a, "s1", "team")) == group_namespace("team")
    assert tenant_of(cache_namespace(a, "s1")) == cache_namespace(a, None)
    assert tenant_of(cache_namespace(None, "s1")) == tenant_of("") == ""


@pytest.mark.anyio
@pytest.mark.parametrize("isolate", [False, True])
async def test_the_namespace_reaches_the_engine(make_app: MakeApp, isolate: bool) -> None:
    app, fake = make_app(config=ServerConfig(api_key=KEYS, isolate_cache_per_key=isolate))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        for key, salt in ((KEYS[0], None), (KEYS[1], None), (KEYS[0], "t"), (KEYS[1], "t")):
            body: dict[str, Any] = {"prompt": "a", "max_tokens": 1}
            if salt is not None:
                body["cache_salt"] = salt
            r = await c.post(
                "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            )
            assert r.status_code == 200, r.text
    ns = fake.namespaces
    if isolate:
        assert len(set(ns)) == 4 and "" not in ns
    else:  # the salt alone scopes sharing: same salt, same namespace, whatever the key
        assert ns[0] == ns[1] == "" and ns[2] == ns[3] != ""
