"""The colocated engine behind the EngineClient interface (what `pd serve --colocated` runs)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from pd.core.backlog import Backlog, ReaderStalled
from pd.core.sampling_params import SamplingParams
from pd.engine.async_engine import AsyncEngine
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from pd.server.app import build_app
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.timeout(120)
PROMPT = [1000 + 37 * i for i in range(30)]


@pytest.fixture(scope="module")
def client(tiny_llama_dir):
    client = AsyncEngine(
        lambda: Engine(EngineConfig(model=str(tiny_llama_dir), max_total_tokens=2048))
    )
    yield client
    client.shutdown()


def _idle(client: AsyncEngine) -> None:
    deadline = time.monotonic() + 10
    while client.call(lambda e: e.has_unfinished):
        assert time.monotonic() < deadline, "request still running"
        time.sleep(0.02)
    client.call(lambda e: e.check_integrity())


def test_generate_streams_hf_tokens_then_finishes(client, tiny_llama_dir):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def run() -> list:
        return [o async for o in client.generate("a", PROMPT, params)]

    outs = asyncio.run(run())
    assert [t for o in outs for t in o.new_token_ids] == hf_greedy(
        tiny_llama_dir, PROMPT, 12, ignore_eos=True
    )
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert not any(o.finished for o in outs[:-1])
    _idle(client)


def test_leaving_the_stream_aborts_the_request(client):
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def run() -> int:
        seen = 0
        gen = client.generate("b", PROMPT, params)
        async for _ in gen:
            seen += 1
            if seen == 3:
                break
        await gen.aclose()
        return seen

    assert asyncio.run(run()) == 3
    _idle(client)


def test_bad_request_raises_and_queues_nothing(client):
    async def run() -> None:
        async for _ in client.generate("c", [], SamplingParams(max_tokens=4)):
            pass

    with pytest.raises(ValueError, match="prompt is empty"):
        asyncio.run(run())
    _idle(client)


def test_http_over_the_colocated_engine(client, tiny_llama_dir):
    engine = client.engine
    app = build_app(
        client, tokenizer=engine.tokenizer, model_name="tiny", max_model_len=engine.max_model_len
    )
    want = engine.tokenizer.decode(
        hf_greedy(tiny_llama_dir, PROMPT, 8, ignore_eos=True), skip_special_tokens=True
    )

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            body = {
                "model": "tiny",
                "prompt": PROMPT,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
            }
            return await http.post("/v1/completions", json=body)

    r = asyncio.run(run())
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want
    _idle(client)


def test_request_larger_than_the_kv_pool_is_a_400(tiny_llama_dir):
    client = AsyncEngine(
        lambda: Engine(EngineConfig(model=str(tiny_llama_dir), max_total_tokens=64))
    )
    engine = client.engine
    app = build_app(
        client, tokenizer=engine.tokenizer, model_name="tiny", max_model_len=engine.max_model_len
    )

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 100})

    try:
        r = asyncio.run(run())
        assert r.status_code == 400, r.text
        assert "needs 129 KV slots, the pool has 64" in r.json()["error"]["message"]
        _idle(client)
    finally:
        client.shutdown()


def test_a_failed_build_raises_in_the_constructor(tiny_llama_dir):
    with pytest.raises(ValueError, match="max_total_tokens"):
        AsyncEngine(lambda: Engine(EngineConfig(model=str(tiny_llama_dir), max_total_tokens=0)))


def test_the_engine_is_built_on_the_thread_that_steps_it(tiny_llama_dir):
    # one OpenMP team per process: see pd/engine/async_engine.py
    built_on = []

    def build() -> Engine:
        built_on.append(threading.current_thread())
        return Engine(EngineConfig(model=str(tiny_llama_dir), max_total_tokens=256))

    client = AsyncEngine(build)
    try:
        assert built_on == [client.call(lambda e: threading.current_thread())]
        assert built_on[0] is not threading.main_thread()
    finally:
        client.shutdown()


def test_a_stream_read_too_slowly_is_paused_resumed_exactly_and_ended_when_stalled(client):
    """A stream's ``Backlog`` (what waits for its reader): a caller that stops reading gets its
    request paused on the engine (its queued bytes stay near the mark, the engine idle, its KV
    kept); read again, it resumes with the tokens of an undisturbed run; a caller that never
    reads again has it ended past ``max_pause_s`` (``ReaderStalled``, its KV freed)."""
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, logprobs=20)
    high = 4096  # ~10 tokens' messages with 20 alternatives each

    async def run(rid: str, backlog: Backlog | None, stall_s: float) -> list[int]:
        tokens: list[int] = []
        async for out in client.generate(rid, PROMPT, params, backlog=backlog):
            tokens += out.new_token_ids
            if len(tokens) == 1 and backlog is not None:  # the caller stops reading
                deadline = time.monotonic() + 30
                while not backlog.is_paused:
                    assert time.monotonic() < deadline, "never paused"
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.3)  # the engine has stopped: nothing more is queued
                queued = backlog.num_bytes
                await asyncio.sleep(stall_s)
                assert backlog.num_bytes == queued <= high + 2 * 1024, (queued, high)
        return tokens

    want = asyncio.run(run("plain", None, 0))
    pauses = client.call(lambda e: e.stats().num_pauses)
    assert asyncio.run(run("resumed", Backlog(high, max_pause_s=30), 0.5)) == want
    assert client.call(lambda e: e.stats().num_pauses) == pauses + 1
    _idle(client)

    with pytest.raises(ReaderStalled, match="did not catch up"):
        asyncio.run(run("stalled", Backlog(high, max_pause_s=1.0), 1.5))
    _idle(client)
