"""The server under uvicorn on loopback: the official openai client, and clients that leave."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, SCRIPT_TEXT, serve, wait_for
from tests.server.fake_engine import FakeEngineClient

pytestmark = pytest.mark.timeout(30)

MakeApp = Callable[..., tuple[Any, FakeEngineClient]]


def test_openai_client_completions_and_chat(make_app: MakeApp) -> None:
    from openai import OpenAI

    app, fake = make_app(num_cached_tokens=1)
    with serve(app) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)
        done = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=64)
        assert done.choices[0].text == SCRIPT_TEXT and done.choices[0].finish_reason == "stop"
        assert done.usage is not None and done.usage.prompt_tokens_details.cached_tokens == 1

        chunks = list(
            client.completions.create(
                model=MODEL_NAME, prompt="Hi", max_tokens=64, stream=True,
                stream_options={"include_usage": True},
            )
        )  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks if c.choices) == SCRIPT_TEXT
        assert chunks[-1].choices == [] and chunks[-1].usage == done.usage

        messages: Any = [{"role": "user", "content": "Hi"}]
        chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=64)
        assert chat.choices[0].message.content == SCRIPT_TEXT
        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=64, stream=True
        )
        deltas = [c.choices[0].delta for c in stream]
        assert deltas[0].role == "assistant"
        assert "".join(d.content or "" for d in deltas) == SCRIPT_TEXT

        from openai import BadRequestError, NotFoundError

        with pytest.raises(BadRequestError, match="n=17 choices, at most 16"):
            client.completions.create(model=MODEL_NAME, prompt="Hi", n=17)
        with pytest.raises(NotFoundError):
            client.completions.create(model="other", prompt="Hi")
    assert fake.aborted == [] and len(fake.finished) == 4


def test_client_leaving_a_stream_aborts_the_request(
    make_app: MakeApp, script_ids: list[int]
) -> None:
    app, fake = make_app(output_ids=script_ids * 20, delay_s=0.02)
    body = {"prompt": "Hi", "max_tokens": 200, "stream": True}
    with serve(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
        # leaving the `with` closed the connection mid-stream
        wait_for(lambda: len(fake.aborted) == 1)
        assert fake.aborted == [fake.requests[0][0]]
        assert fake.cancelled == [fake.requests[0][0]] and fake.finished == []
        text = client.get("/metrics").text
    assert 'pd_requests_total{finish_reason="abort"} 1.0' in text
    assert "pd_server_running_requests 0.0" in text


def test_client_leaving_a_non_streaming_request_aborts_it(
    make_app: MakeApp, script_ids: list[int]
) -> None:
    app, fake = make_app(output_ids=script_ids * 20, delay_s=0.02)
    with serve(app) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 200}, timeout=0.3
            )
        wait_for(lambda: len(fake.aborted) == 1)
    assert fake.aborted == [fake.requests[0][0]] and fake.finished == []
