"""Per-API-key limits: requests in flight and tokens per minute, each a 429 with Retry-After in
OpenAI's shape, one key's use never another's; the window itself on a fake clock."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from pd.server import ServerConfig
from pd.server.http.errors import APIError
from pd.server.http.key_limits import KeyLimiter, TokenWindow
from tests.server.conftest import serve
from tests.server.fake_engine import FakeEngineClient

pytestmark = pytest.mark.timeout(60)
MakeApp = Callable[..., tuple[Any, FakeEngineClient]]
A, B = "key-a-0123456789", "key-b-0123456789"
ADMIN = "key-admin-0123456789"


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_the_window_counts_60_seconds_and_says_when_a_key_is_under_again() -> None:
    w = TokenWindow()
    w.add(30, 100.2)
    w.add(20, 100.9)  # same second: one bucket
    w.add(50, 130.5)
    assert w.num_tokens == 100
    assert w.seconds_until_below(101, 131.0) == 0.0  # under the limit now
    # at 100: the first second's 50 must leave (at 160); at 60 as well; at 51 the 50 of 130 too
    assert w.seconds_until_below(100, 131.0) == pytest.approx(29.0)
    assert w.seconds_until_below(60, 131.0) == pytest.approx(29.0)
    assert w.seconds_until_below(50, 131.0) == pytest.approx(59.0)
    w.expire(160.0)
    assert w.num_tokens == 50
    w.expire(190.0)
    assert w.num_tokens == 0 and w.seconds_until_below(1, 190.0) == 0.0


def test_the_limiter_counts_per_key_and_refuses_with_the_numbers() -> None:
    now = [1000.0]
    limiter = KeyLimiter(max_inflight=2, max_tokens_per_minute=100, clock=lambda: now[0])
    limiter.begin(A)
    limiter.begin(A)
    with pytest.raises(APIError) as refused:
        limiter.begin(A)
    assert refused.value.status_code == 429
    assert refused.value.headers == {"Retry-After": "1"}
    limiter.begin(B)  # another key's place
    limiter.end(A)
    limiter.add_tokens(A, 100)
    with pytest.raises(APIError) as refused:
        limiter.begin(A)
    assert refused.value.headers == {"Retry-After": "60"}
    assert "used 100 tokens in the last 60 s, its limit is 100" in str(refused.value)
    now[0] = 1059.5
    with pytest.raises(APIError) as refused:
        limiter.begin(A)
    assert refused.value.headers == {"Retry-After": "1"}
    now[0] = 1060.0
    limiter.begin(A)
    for key in (A, A, B):
        limiter.end(key)
    assert limiter.num_inflight == {} and limiter.num_tokens(A) == 0


@pytest.mark.anyio
async def test_requests_in_flight_per_key_get_429_and_their_places_come_back(
    make_app: MakeApp,
) -> None:
    """Two streams of key A held open: A's third request is a 429 at once (before admission:
    it never reaches the engine), B's goes through; a stream whose client leaves gives its
    place back, so A is served again."""
    config = ServerConfig(api_key=(A, B), admin_api_key=(ADMIN,), max_inflight_per_key=2)
    app, fake = make_app(config=config, output_ids=list(range(100, 140)), delay_s=0.05)
    limiter = app.state.key_limiter
    body = {"prompt": "hello", "max_tokens": 40, "stream": True}
    with serve(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            streams = [c.stream("POST", "/v1/completions", json=body, headers=_auth(A))]
            streams.append(c.stream("POST", "/v1/completions", json=body, headers=_auth(A)))
            opened = [await s.__aenter__() for s in streams]
            assert [r.status_code for r in opened] == [200, 200]
            assert limiter.num_inflight == {A: 2}
            r = await c.post("/v1/completions", json={"prompt": "x"}, headers=_auth(A))
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert r.json()["error"]["code"] == "key_inflight_limit"
            assert len(fake.requests) == 2
            r = await c.post("/v1/completions", json={"prompt": "x"}, headers=_auth(B))
            assert r.status_code == 200
            for s in streams:  # the clients leave mid-stream
                await s.__aexit__(None, None, None)
            for _ in range(200):
                if not limiter.num_inflight:
                    break
                await asyncio.sleep(0.02)
            assert limiter.num_inflight == {}
            r = await c.post("/v1/completions", json={"prompt": "x"}, headers=_auth(A))
            assert r.status_code == 200
            text = (await c.get("/metrics", headers=_auth(ADMIN))).text
    assert len(fake.cancelled) + len(fake.aborted) >= 2  # the left streams were ended
    assert 'pd_server_rejected_requests_total{reason="key_inflight"} 1.0' in text


@pytest.mark.anyio
async def test_tokens_per_minute_per_key_get_429_with_the_seconds_to_wait(
    make_app: MakeApp,
) -> None:
    """A key's prompt and completion tokens count in a 60 s window: at the limit its requests
    get 429 with Retry-After = the seconds until enough tokens have left it; another key is
    untouched; once the window moves on, the key is served again."""
    config = ServerConfig(api_key=(A, B), admin_api_key=(ADMIN,), max_tokens_per_minute_per_key=40)
    app, fake = make_app(config=config)
    now = [1000.25]
    limiter = app.state.key_limiter
    limiter.clock = lambda: now[0]
    body = {"prompt": "hello there", "max_tokens": 15}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        used = 0
        for _ in range(3):  # each is under the limit when it starts
            r = await c.post("/v1/completions", json=body, headers=_auth(A))
            assert r.status_code == 200, r.text
            used += r.json()["usage"]["total_tokens"]
            if used >= 40:
                break
        assert limiter.num_tokens(A) == used >= 40  # prompt + completion, as the usage says
        num_run = len(fake.requests)
        now[0] = 1030.5
        r = await c.post("/v1/completions", json=body, headers=_auth(A))
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "30"  # the tokens of second 1000 leave at 1060
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "key_token_limit"
        assert f"used {used} tokens in the last 60 s, its limit is 40" in err["message"], err
        assert len(fake.requests) == num_run  # refused before anything ran
        assert (await c.post("/generate", json={"text": "hi"}, headers=_auth(A))).status_code == 429
        r = await c.post("/v1/completions", json=body, headers=_auth(B))
        assert r.status_code == 200  # another key's window
        assert (await c.get("/v1/models", headers=_auth(A))).status_code == 200  # not counted
        now[0] = 1060.0
        r = await c.post("/v1/completions", json=body, headers=_auth(A))
        assert r.status_code == 200
        text = (await c.get("/metrics", headers=_auth(ADMIN))).text
    assert 'pd_server_rejected_requests_total{reason="key_tokens"} 2.0' in text


@pytest.mark.anyio
async def test_a_request_produces_at_most_its_keys_tokens_left_counted_as_they_come(
    make_app: MakeApp,
) -> None:
    """What a request may still produce counts against its key: a stream asking for 40 tokens
    under a limit of 20 is given the tokens left (its max_tokens lowered: finish_reason
    "length"), reserved while it runs, so the key's next request gets 429 meanwhile; its
    tokens count as they come, each once, and the key never passes its limit."""
    config = ServerConfig(api_key=(A,), max_tokens_per_minute_per_key=20)
    app, fake = make_app(config=config, output_ids=list(range(100, 140)), delay_s=0.02)
    limiter = app.state.key_limiter
    body = {
        "prompt": "hello", "max_tokens": 40, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    with serve(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            async with c.stream("POST", "/v1/completions", json=body, headers=_auth(A)) as s:
                assert s.status_code == 200
                while limiter.num_tokens(A) < 5:
                    await asyncio.sleep(0.005)
                r = await c.post("/v1/completions", json={"prompt": "x"}, headers=_auth(A))
                assert r.status_code == 429 and r.json()["error"]["code"] == "key_token_limit"
                assert not fake.finished  # refused while the stream runs
                chunks = [line[6:] async for line in s.aiter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    usage = json.loads(chunks[-2])["usage"]
    assert usage["total_tokens"] == 20  # the key's whole minute, not 40 past it
    assert json.loads(chunks[-3])["choices"][0]["finish_reason"] == "length"
    assert limiter.num_tokens(A) == 20 and limiter.num_reserved == {}
    assert len(fake.requests) == 1 and len(fake.finished) == 1


@pytest.mark.anyio
async def test_n_choices_without_max_tokens_stay_within_the_keys_limit(make_app: MakeApp) -> None:
    """n=16 without max_tokens (the rest of the context each) reserved what the key has left:
    every choice's tokens together and the prompt stay within the limit."""
    config = ServerConfig(api_key=(A,), max_tokens_per_minute_per_key=100)
    app, fake = make_app(config=config, output_ids=list(range(100, 400)))
    limiter = app.state.key_limiter
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.post("/v1/completions", json={"prompt": "hello", "n": 16}, headers=_auth(A))
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["total_tokens"] <= 100 and usage["completion_tokens"] >= 16
        assert limiter.num_tokens(A) == usage["total_tokens"] and limiter.num_reserved == {}
        # the minute is spent: the next request waits for the window
        r = await c.post("/v1/completions", json={"prompt": "hello", "n": 16, "max_tokens": 1},
                         headers=_auth(A))  # fmt: skip
        assert r.status_code == 429, r.text  # the minute is spent: wait
