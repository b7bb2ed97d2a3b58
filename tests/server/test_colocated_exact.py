"""``pd serve --colocated --quantization none --speculative-tokens 4`` over HTTP (the server app
over the colocated engine, SmolLM2 in fp32, speculating in batches up to 8): every answer is
HF transformers' greedy one, cold, warm and 8 at once, streamed too, and drafts were accepted."""

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
from pd.model.tokenizer import encode_prompt
from pd.server import ServerConfig, build_app
from tests.hf_reference import hf_greedy
from tests.server.conftest import check_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The largest planet in the solar system is",
    "Repeat after me: red green blue, red green blue, red green blue,",
    "My favourite book is",
    "import numpy as np\n",
    "1, 2, 3, 4, 5, 6, 7, 8,",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path) -> Iterator[AsyncEngine]:
    cfg = EngineConfig(
        model=str(smollm2_dir),
        quantization="none",
        speculative_tokens=4,
        speculative_max_batch=8,
        max_total_tokens=4096,
    )
    client = AsyncEngine(lambda: Engine(cfg))
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def app(engine: AsyncEngine) -> Any:
    inner = engine.engine
    return build_app(
        engine,
        tokenizer=inner.tokenizer,
        model_name="SmolLM2-135M-Instruct",
        max_model_len=inner.max_model_len,
        config=ServerConfig(),
    )


async def _generate(http: httpx.AsyncClient, ids: list[int]) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}}
    r = await http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _accepted(engine: AsyncEngine) -> int:
    return engine.call(lambda e: e.stats().num_accepted_draft_tokens)


def _run(app: Any, calls: list[list[int]], concurrent: bool) -> list[list[int]]:
    async def run() -> list[list[int]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=300) as h:
            if concurrent:
                return list(await asyncio.gather(*(_generate(h, ids) for ids in calls)))
            return [await _generate(h, ids) for ids in calls]

    return asyncio.run(run())


def test_every_answer_is_hfs_cold_warm_and_eight_at_once(app, engine, smollm2_dir) -> None:
    tokenizer = engine.engine.tokenizer
    prompts = [encode_prompt(tokenizer, p) for p in PROMPTS]
    want = [hf_greedy(smollm2_dir, ids, MAX_TOKENS) for ids in prompts]
    before = _accepted(engine)
    assert _run(app, prompts, concurrent=False) == want  # cold
    assert _run(app, prompts, concurrent=False) == want  # warm: every prompt cached
    assert _run(app, prompts, concurrent=True) == want  # 8 at once
    assert _accepted(engine) - before > 20  # it did speculate
    check_idle(engine, app)


def test_streamed_tokens_are_the_answer_once_and_in_order(app, engine, smollm2_dir) -> None:
    tokenizer = engine.engine.tokenizer
    prompt = PROMPTS[4]
    want = tokenizer.decode(
        hf_greedy(smollm2_dir, encode_prompt(tokenizer, prompt), MAX_TOKENS),
        skip_special_tokens=True,
    )

    async def run() -> tuple[str, int]:
        transport = httpx.ASGITransport(app=app)
        body = {
            "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        text, usage = "", 0
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=300) as h:
            async with h.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = httpx.Response(200, content=line[6:]).json()
                        text += "".join(c["text"] for c in chunk["choices"])
                        usage = (chunk.get("usage") or {}).get("completion_tokens", usage)
        return text, usage

    text, usage = asyncio.run(run())
    assert text == want and usage == MAX_TOKENS
    check_idle(engine, app)
