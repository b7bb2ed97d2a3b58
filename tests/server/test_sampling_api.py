"""Penalties, min_p and logprobs through the HTTP API with the official openai client, over
the colocated engine (tiny random model) under uvicorn on loopback: what comes back equals the
engine's own run of the same request, streamed or not, in OpenAI's shapes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pd.core.sampling_params import SamplingParams
from tests.server.conftest import check_idle, colocated_app, serve

pytestmark = pytest.mark.timeout(120)

PROMPT = [1000 + 37 * (i % 7) for i in range(30)]  # repetitive: repetition_penalty bites
PENALTIES = {"frequency_penalty": 1.5, "presence_penalty": 0.5}
EXTRA = {"repetition_penalty": 1.3, "min_p": 0.1}  # vLLM's fields: the client's extra_body


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path) -> Iterator[tuple[Any, Any, Any]]:
    """(the AsyncEngine, the app, an openai client of the server)."""
    from openai import OpenAI

    client, app = colocated_app(tiny_llama_dir, max_total_tokens=2048)
    with serve(app) as url:
        yield client, app, OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    client.shutdown()


def _engine_run(client: Any, prompt: list[int], params: SamplingParams) -> tuple[list[int], list]:
    """The engine's own tokens and logprobs for the request (on its thread, while idle)."""

    def run(engine: Any) -> tuple[list[int], list]:
        rid = engine.add_request(prompt, params)
        tokens, lps = [], []
        while engine.has_unfinished:
            for out in engine.step():
                assert out.request_id == rid and out.error is None
                tokens += out.new_token_ids
                lps += out.logprobs
        return tokens, lps

    return client.call(run)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_completions_penalties_and_logprobs_equal_the_engine(served, temperature) -> None:
    client, app, oai = served
    tokenizer = client.engine.tokenizer
    kw: dict[str, Any] = dict(max_tokens=8, temperature=temperature, seed=4, **PENALTIES)
    done = oai.completions.create(model="tiny", prompt=PROMPT, logprobs=3, extra_body=EXTRA, **kw)
    params = SamplingParams(**kw, **EXTRA, logprobs=3)
    tokens, lps = _engine_run(client, PROMPT, params)
    plain = SamplingParams(max_tokens=8, temperature=temperature, seed=4, logprobs=3)
    _, plain_lps = _engine_run(client, PROMPT, plain)
    assert lps != plain_lps, "the penalties changed nothing: the test would check nothing"
    got = done.choices[0].logprobs
    assert got is not None and done.usage is not None and done.usage.completion_tokens == 8
    assert got.tokens == [tokenizer.decode([t]) for t in tokens]
    assert got.token_logprobs == [lp.logprob for lp in lps]
    for top, lp, text in zip(got.top_logprobs or [], lps, got.tokens):
        want = {tokenizer.decode([t]): v for t, v in zip(lp.top_ids, lp.top_logprobs)}
        assert {k: top[k] for k in want} == want and top[text] == lp.logprob
    offsets = [0]
    for text in got.tokens[:-1]:
        offsets.append(offsets[-1] + len(text))
    assert got.text_offset == offsets
    # streamed: the same tokens and numbers, the offsets running on across chunks
    chunks = list(
        oai.completions.create(
            model="tiny", prompt=PROMPT, logprobs=3, extra_body=EXTRA, stream=True, **kw
        )
    )
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == got.tokens
    assert [v for s in streamed for v in s.token_logprobs] == got.token_logprobs
    assert [o for s in streamed for o in s.text_offset] == got.text_offset
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    check_idle(client, app)


def test_chat_logprobs_streamed_and_not(served) -> None:
    client, app, oai = served
    messages: Any = [{"role": "user", "content": "Say something."}]
    kw: dict[str, Any] = dict(model="tiny", messages=messages, max_tokens=6, temperature=0)
    done = oai.chat.completions.create(logprobs=True, top_logprobs=2, **kw)
    content = done.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    for entry in content:
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        # greedy without penalties: the token is the most likely one
        assert (entry.token, entry.logprob) == (
            entry.top_logprobs[0].token,
            entry.top_logprobs[0].logprob,
        )
    stream = oai.chat.completions.create(logprobs=True, top_logprobs=2, stream=True, **kw)
    entries = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    assert [e.model_dump() for e in entries] == [e.model_dump() for e in content]
    # logprobs true alone: the token's logprob, no alternatives; none asked: none sent
    alone = oai.chat.completions.create(logprobs=True, **kw).choices[0].logprobs
    assert alone is not None and [e.top_logprobs for e in alone.content or []] == [[]] * 6
    assert oai.chat.completions.create(**kw).choices[0].logprobs is None
    check_idle(client, app)


def test_refused_combinations_say_why(served) -> None:
    from openai import BadRequestError

    _, _, oai = served
    messages: Any = [{"role": "user", "content": "Hi"}]
    with pytest.raises(BadRequestError, match="top_logprobs"):
        oai.chat.completions.create(model="tiny", messages=messages, logprobs=True, top_logprobs=21)
    with pytest.raises(BadRequestError, match="needs logprobs=true"):
        oai.chat.completions.create(model="tiny", messages=messages, top_logprobs=3)
    with pytest.raises(BadRequestError, match="cached prompt prefix"):
        oai.completions.create(model="tiny", prompt="Hi", echo=True, logprobs=1)
    with pytest.raises(BadRequestError, match="presence_penalty"):
        oai.completions.create(model="tiny", prompt="Hi", presence_penalty=2.5)
    with pytest.raises(BadRequestError, match="repetition_penalty"):
        oai.completions.create(model="tiny", prompt="Hi", extra_body={"repetition_penalty": 0})
