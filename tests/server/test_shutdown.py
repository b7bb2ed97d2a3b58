"""``ServerState.shut_down`` (what SIGTERM runs in ``pd serve``; the signal itself is tested
on a real process in tests/cluster/test_serve_sigterm.py) past its grace period: running
answers are cut (finish reason "abort", the stream ends properly), queued requests and new ones
get 503, and no place is held."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from pd.server import ServerConfig
from tests.server.conftest import serve, wait_for
from tests.server.fake_engine import FakeEngineClient

pytestmark = pytest.mark.timeout(30)

MakeApp = Callable[..., tuple[Any, FakeEngineClient]]
LONG = {"prompt": "Hi", "max_tokens": 400, "ignore_eos": True}


def _post(url: str, body: dict[str, Any], out: dict[str, Any]) -> None:
    """The status and the non-empty lines of the answer."""
    with httpx.Client(base_url=url, timeout=20) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            out["status"] = r.status_code
            out["lines"] = [line for line in r.iter_lines() if line]


def test_past_its_grace_running_answers_are_cut_and_the_queue_refused(
    make_app: MakeApp, script_ids: list[int]
) -> None:
    app, fake = make_app(
        config=ServerConfig(max_inflight_requests=2),
        output_ids=script_ids * 40,
        delay_s=0.02,  # 400 tokens: 8 s, far past the grace period
        max_model_len=4096,
    )
    state = app.state.server
    bodies = [{**LONG, "stream": True}, LONG, LONG]  # a stream, a plain one, one queued
    results: list[dict[str, Any]] = [{} for _ in bodies]
    with serve(app) as url:
        threads = []
        for i, (body, out) in enumerate(zip(bodies, results, strict=True)):
            thread = threading.Thread(target=_post, args=(url, body, out))
            thread.start()
            threads.append(thread)
            wait_for(lambda i=i: len(fake.requests) == min(i + 1, 2))  # in this order
        wait_for(lambda: state.admission.num_queued == 1)
        assert fake.loop is not None
        done = asyncio.run_coroutine_threadsafe(state.shut_down(0.5), fake.loop)
        assert done.result(timeout=10) is False  # requests were left: cut
        for thread in threads:
            thread.join(10)
        refused = httpx.post(f"{url}/v1/completions", json=LONG, timeout=10)
        wait_for(lambda: state.admission.is_empty)
    stream, plain, queued = results
    assert stream["status"] == 200 and stream["lines"][-1] == "data: [DONE]"
    last = json.loads(stream["lines"][-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "abort"
    assert plain["status"] == 200
    assert json.loads(plain["lines"][0])["choices"][0]["finish_reason"] == "abort"
    for r in (queued, {"status": refused.status_code, "lines": [refused.text]}):
        assert r["status"] == 503, r
        assert json.loads(r["lines"][0])["error"]["code"] == "server_shutting_down"
    assert set(fake.aborted) == {rid for rid, _, _ in fake.requests}
    assert refused.headers["Retry-After"] and refused.headers["Connection"] == "close"


@pytest.mark.anyio
async def test_within_its_grace_it_waits_for_the_requests_in_flight(
    make_app: MakeApp, script_ids: list[int]
) -> None:
    app, fake = make_app(output_ids=script_ids, delay_s=0.01)
    state = app.state.server
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        running = asyncio.ensure_future(http.post("/v1/completions", json={"prompt": "Hi"}))
        while not fake.requests:
            await asyncio.sleep(0.01)
        assert await state.shut_down(10.0) is True
        assert running.done() and (await running).status_code == 200
        refused = await http.post("/v1/completions", json={"prompt": "Hi"})
        ready, health = await http.get("/ready"), await http.get("/health")
    assert refused.status_code == 503 and fake.aborted == []
    assert ready.status_code == 503 and ready.json()["reason"] == "the server is shutting down"
    assert health.status_code == 200  # out of rotation, not restarted
    assert fake.finished == [fake.requests[0][0]]
