"""Admission control (in-flight limit + FIFO queue, 429/503), and the request deadline."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from pd.server import ServerConfig, ServerMetrics
from pd.server.http.admission import Admission
from pd.server.http.errors import APIError
from tests.server.conftest import serve, wait_for
from tests.server.fake_engine import FakeEngineClient

pytestmark = pytest.mark.timeout(30)

MakeApp = Callable[..., tuple[Any, FakeEngineClient]]


# -- the Admission class ----------------------------------------------------------------------


async def _settle() -> None:
    """Let woken waiters run (a handed-over place takes a few loop turns to arrive)."""
    for _ in range(10):
        await asyncio.sleep(0)


async def _admitted_in_order(adm: Admission, names: list[str], order: list[str]) -> dict:
    """Start one admit() task per name (in order, each queued before the next starts)."""
    tasks = {}
    for name in names:

        async def one(name: str = name) -> Any:
            ticket = await adm.admit(10.0)
            order.append(name)
            return ticket

        tasks[name] = asyncio.ensure_future(one())
        await asyncio.sleep(0)
    return tasks


@pytest.mark.anyio
async def test_fifo_queue_bounded_with_429_and_places_handed_over() -> None:
    adm = Admission(max_inflight=2, max_queued=3, metrics=ServerMetrics())
    order: list[str] = []
    tasks = await _admitted_in_order(adm, ["a", "b", "c", "d", "e"], order)
    await _settle()
    assert order == ["a", "b"] and (adm.num_inflight, adm.num_queued) == (2, 3)
    with pytest.raises(APIError) as full:
        await adm.admit(10.0)
    assert full.value.status_code == 429 and full.value.headers == {"Retry-After": "1"}
    assert full.value.type == "rate_limit_error"
    tasks["d"].cancel()  # a client leaves the queue
    await _settle()
    assert adm.num_queued == 2
    tasks["a"].result().release()
    tasks["a"].result().release()  # idempotent
    await _settle()
    assert order == ["a", "b", "c"] and adm.num_inflight == 2
    for name in ("b", "c"):
        tasks[name].result().release()
        await _settle()
    assert order == ["a", "b", "c", "e"] and (adm.num_inflight, adm.num_queued) == (1, 0)
    tasks["e"].result().release()
    assert adm.num_inflight == 0


@pytest.mark.anyio
async def test_a_place_handed_to_a_leaving_waiter_is_passed_on() -> None:
    adm = Admission(max_inflight=1, max_queued=2, metrics=ServerMetrics())
    order: list[str] = []
    tasks = await _admitted_in_order(adm, ["a", "b", "c"], order)
    tasks["a"].result().release()  # hands the place to b's future ...
    tasks["b"].cancel()  # ... as b's client leaves, before b runs
    await _settle()
    assert tasks["b"].cancelled() and order == ["a", "c"]
    assert (adm.num_inflight, adm.num_queued) == (1, 0)
    tasks["c"].result().release()
    assert adm.num_inflight == 0


@pytest.mark.anyio
async def test_waiting_past_the_timeout_is_504_and_leaves_the_queue() -> None:
    metrics = ServerMetrics()
    adm = Admission(max_inflight=1, max_queued=1, metrics=metrics)
    ticket = await adm.admit(1.0)
    with pytest.raises(APIError) as late:
        await adm.admit(0.05)
    assert late.value.status_code == 504 and late.value.code == "request_timeout"
    assert (adm.num_inflight, adm.num_queued) == (1, 0)
    ticket.release()
    assert 'pd_server_rejected_requests_total{reason="timeout"} 1.0' in metrics.render().decode()


# -- over HTTP --------------------------------------------------------------------------------


def _completions(url: str, body: dict[str, Any], timeout_s: float = 10.0) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s)


def test_overload_is_429_with_retry_after_and_queued_requests_run_in_order(
    make_app: MakeApp, script_ids: list[int]
) -> None:
    cfg = ServerConfig(max_inflight_requests=1, max_queued_requests=2)
    app, fake = make_app(config=cfg, output_ids=script_ids, delay_s=0.2)
    state = app.state.server
    with serve(app) as url:
        results: dict[int, httpx.Response] = {}

        def send(i: int) -> None:
            results[i] = _completions(url, {"prompt": f"request {i}", "max_tokens": 5})

        threads = []
        for i in range(3):  # one runs, two queue, in this order
            threads.append(threading.Thread(target=send, args=(i,)))
            threads[-1].start()
            wait_for(lambda i=i: len(fake.requests) + state.admission.num_queued > i)
        refused = _completions(url, {"prompt": "one too many"})
        metrics = httpx.get(f"{url}/metrics").text
        for t in threads:
            t.join(10)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert "pd_server_queued_requests 2.0" in metrics
    assert 'pd_server_rejected_requests_total{reason="queue_full"} 1.0' in metrics
    assert [results[i].status_code for i in range(3)] == [200, 200, 200]
    prompts = [fake.requests[i][1] for i in range(3)]
    assert prompts == [app.state.server.tokenizer.encode(f"request {i}") for i in range(3)]
    assert (state.admission.num_inflight, state.admission.num_queued) == (0, 0)


@pytest.mark.anyio
async def test_not_ready_is_503_with_retry_after(make_app: MakeApp) -> None:
    app, fake = make_app(ready=False)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user"}]})
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["error"]["code"] == "engine_not_ready" and fake.requests == []


def test_a_client_leaving_the_queue_frees_its_place_in_line(
    make_app: MakeApp, script_ids: list[int]
) -> None:
    cfg = ServerConfig(max_inflight_requests=1, max_queued_requests=1)
    app, fake = make_app(config=cfg, output_ids=script_ids * 3, delay_s=0.01)
    adm = app.state.server.admission
    with serve(app) as url:
        first = threading.Thread(target=_completions, args=(url, {"prompt": "a", "max_tokens": 60}))
        first.start()
        wait_for(lambda: adm.num_inflight == 1)
        with pytest.raises(httpx.ReadTimeout):
            _completions(url, {"prompt": "queued then gone"}, timeout_s=0.2)
        wait_for(lambda: adm.num_queued == 0)
        third = _completions(url, {"prompt": "c", "max_tokens": 2})  # queues, then runs
        first.join(10)
    assert third.status_code == 200 and len(fake.requests) == 2  # the leaver never ran
    assert (adm.num_inflight, adm.num_queued) == (0, 0)


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True])
async def test_request_past_its_deadline_is_aborted_and_answered(
    make_app: MakeApp, script_ids: list[int], stream: bool
) -> None:
    cfg = ServerConfig(request_timeout=0.3)
    app, fake = make_app(config=cfg, output_ids=script_ids * 10, delay_s=0.05)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        body = {"prompt": "a", "max_tokens": 200, "stream": stream}
        r = await c.post("/v1/completions", json=body)
        metrics = (await c.get("/metrics")).text
    if stream:
        events = [e for e in r.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]" and len(events) >= 3  # some text came first
        err = json.loads(events[-2][len("data: ") :])["error"]
    else:
        assert r.status_code == 504
        err = r.json()["error"]
    assert (err["type"], err["code"]) == ("timeout_error", "request_timeout")
    assert fake.aborted == [fake.requests[0][0]] and fake.finished == []
    assert 'pd_server_rejected_requests_total{reason="timeout"} 1.0' in metrics
    assert app.state.server.admission.num_inflight == 0


def test_streams_give_their_place_back_however_they_end(
    make_app: MakeApp, script_ids: list[int]
) -> None:
    app, fake = make_app(output_ids=script_ids * 20, delay_s=0.01)
    adm = app.state.server.admission
    body = {"prompt": "Hi", "max_tokens": 200, "stream": True}
    with serve(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert next(r.iter_lines()).startswith("data: {")
            assert adm.num_inflight == 1
        wait_for(lambda: adm.num_inflight == 0 and len(fake.aborted) == 1)
        r = client.post("/v1/completions", json={**body, "max_tokens": 3})
        assert r.text.endswith("data: [DONE]\n\n")
    assert adm.num_inflight == 0
