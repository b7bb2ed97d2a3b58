"""The server over the colocated engine (tiny random model): per-key cache isolation,
cache_salt, logit_bias and tiny temperatures, end to end."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pd.engine.async_engine import AsyncEngine
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from pd.server import ServerConfig, build_app
from tests.server.conftest import check_idle

pytestmark = pytest.mark.timeout(120)

KEYS = ("tenant-a-secret", "tenant-b-secret")
PROMPT = [1000 + 37 * i for i in range(40)]


@pytest.fixture(scope="module")
def client(tiny_llama_dir: Path) -> Iterator[AsyncEngine]:
    client = AsyncEngine(
        lambda: Engine(EngineConfig(model=str(tiny_llama_dir), max_total_tokens=2048))
    )
    yield client
    client.shutdown()


def _app(client: AsyncEngine, **cfg: Any) -> Any:
    engine = client.engine
    return build_app(
        client,
        tokenizer=engine.tokenizer,
        model_name="tiny",
        max_model_len=engine.max_model_len,
        config=ServerConfig(**cfg),
    )


def _post_all(
    app: Any, requests: list[tuple[str | None, dict[str, Any]]], path: str = "/v1/completions"
) -> list[Any]:
    """POST each (key, body) to ``path`` in turn; the JSON answers."""

    async def run() -> list[Any]:
        transport = httpx.ASGITransport(app=app)
        out = []
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            for key, body in requests:
                headers = {} if key is None else {"Authorization": f"Bearer {key}"}
                r = await http.post(path, json=body, headers=headers)
                assert r.status_code == 200, r.text
                out.append(r.json())
        return out

    return asyncio.run(run())


def _cached(answers: list[Any]) -> list[int]:
    return [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]


def test_keys_do_not_share_cached_prefixes_when_isolated(client: AsyncEngine) -> None:
    app = _app(client, api_key=KEYS, isolate_cache_per_key=True)
    prompt = [p + 1 for p in PROMPT]
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    a, b = KEYS
    cached = _cached(_post_all(app, [(a, body), (b, body), (a, body), (b, body)]))
    assert cached[:2] == [0, 0], "a key reused another key's cached prefix"
    assert cached[2] >= len(prompt) - 1 and cached[3] >= len(prompt) - 1, cached
    check_idle(client, app)


def test_cache_salt_scopes_sharing(client: AsyncEngine) -> None:
    app = _app(client)
    prompt = [p + 2 for p in PROMPT]
    plain = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    salted = {**plain, "cache_salt": "tenant-x"}
    other = {**plain, "cache_salt": "tenant-y"}
    cached = _cached(_post_all(app, [(None, plain), (None, salted), (None, other), (None, salted)]))
    assert cached[:3] == [0, 0, 0] and cached[3] >= len(prompt) - 1, cached
    check_idle(client, app)


def test_logit_bias_and_tiny_temperature_end_to_end(client: AsyncEngine) -> None:
    app = _app(client)
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    greedy = {"input_ids": PROMPT, "sampling_params": sp}
    forced = {"input_ids": PROMPT, "sampling_params": {**sp, "logit_bias": {"4242": 100}}}
    tiny = {"input_ids": PROMPT, "sampling_params": {**sp, "temperature": 1e-7, "seed": 5}}
    answers = _post_all(app, [(None, greedy), (None, forced), (None, tiny)], "/generate")
    ids = answers[0]["output_ids"]
    assert answers[1]["output_ids"] == [4242] * 6
    assert answers[2]["output_ids"] == ids
    banned = {"input_ids": PROMPT, "sampling_params": {**sp, "logit_bias": {str(ids[0]): -100}}}
    (answer,) = _post_all(app, [(None, banned)], "/generate")
    assert answer["output_ids"][0] != ids[0]
    check_idle(client, app)


def test_the_colocated_engine_is_ready_while_its_thread_runs(tiny_llama_dir: Path) -> None:
    engine = AsyncEngine(
        lambda: Engine(EngineConfig(model=str(tiny_llama_dir), max_total_tokens=256))
    )
    try:
        assert asyncio.run(engine.readiness()) is None
    finally:
        engine.shutdown()
    assert asyncio.run(engine.readiness()) == "the engine thread is not running"
