"""``n`` choices through the HTTP API with the official openai client, over the colocated
engine (tiny random model) under uvicorn on loopback: n choices, streamed and not, greedy ones
identical, seeded ones what vLLM's rule (choice i: seed + i) gives, the prompt's KV computed
once and shared, usage counting the prompt once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pd.core.sampling_params import SamplingParams
from tests.server.conftest import check_idle, colocated_app, serve

pytestmark = pytest.mark.timeout(120)

PROMPT = [200 + (13 * i) % 300 for i in range(48)]


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path) -> Iterator[tuple[Any, Any, Any]]:
    """(the AsyncEngine, the app, an openai client of the server)."""
    from openai import OpenAI

    client, app = colocated_app(tiny_llama_dir, max_total_tokens=4096)
    with serve(app) as url:
        yield client, app, OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    client.shutdown()


def _engine_tokens(client: Any, prompt: list[int], params: SamplingParams) -> list[int]:
    def run(engine: Any) -> list[int]:
        engine.add_request(prompt, params)
        tokens: list[int] = []
        while engine.has_unfinished:
            for out in engine.step():
                tokens += out.new_token_ids
        return tokens

    return client.call(run)


def _stats(client: Any) -> Any:
    return client.call(lambda engine: engine.stats())


def test_n_completions_seeded_follow_vllms_rule_and_share_the_prompt(served) -> None:
    client, app, oai = served
    tok = client.engine.tokenizer
    kw: dict[str, Any] = dict(
        max_tokens=12, temperature=1.0, seed=7, extra_body={"ignore_eos": True}
    )
    before = _stats(client)
    done = oai.completions.create(model="tiny", prompt=PROMPT, n=3, **kw)
    after = _stats(client)
    assert [c.index for c in done.choices] == [0, 1, 2]
    # vLLM's rule: choice i samples as a request of its own with seed + i
    want = [
        _engine_tokens(
            client,
            PROMPT,
            SamplingParams(max_tokens=12, temperature=1.0, seed=7 + i, ignore_eos=True),
        )
        for i in range(3)
    ]
    assert [c.text for c in done.choices] == [tok.decode(w) for w in want]
    assert len({c.text for c in done.choices}) == 3, "the seeds gave equal choices"
    assert done.usage is not None
    assert done.usage.prompt_tokens == len(PROMPT)  # once
    assert done.usage.completion_tokens == 3 * 12
    # the prompt was computed once: choices 1 and 2 found it in the prefix cache
    hit = after.num_hit_tokens - before.num_hit_tokens
    miss = after.num_miss_tokens - before.num_miss_tokens
    print(f"n=3, prompt {len(PROMPT)}: hit {hit}, miss {miss} tokens")
    assert hit >= 2 * (len(PROMPT) - 1), (hit, miss)
    # each choice computes only the prompt's last token again (a match leaves one to compute);
    # three choices each prefilling the prompt would miss 3 x 48
    assert miss <= len(PROMPT) + 2, (hit, miss)
    # reproducible across runs
    again = oai.completions.create(model="tiny", prompt=PROMPT, n=3, **kw)
    assert [c.text for c in again.choices] == [c.text for c in done.choices]
    check_idle(client, app)


def test_n_streamed_chat_by_index_and_greedy_identical(served) -> None:
    client, app, oai = served
    msgs = [{"role": "user", "content": "Tell me a story about a cat."}]
    kw: dict[str, Any] = dict(
        model="tiny", messages=msgs, max_tokens=10, n=3, extra_body={"ignore_eos": True}
    )
    greedy = oai.chat.completions.create(temperature=0.0, **kw)
    texts = [c.message.content for c in greedy.choices]
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert texts[0] and texts == [texts[0]] * 3
    assert greedy.usage is not None and greedy.usage.completion_tokens == 3 * 10
    stream = oai.chat.completions.create(
        temperature=0.0, stream=True, stream_options={"include_usage": True}, **kw
    )
    parts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                finishes[c.index] = c.finish_reason
    assert parts == {i: texts[0] for i in range(3)}
    assert set(finishes) == {0, 1, 2}
    assert usage is not None and usage.completion_tokens == greedy.usage.completion_tokens
    assert usage.prompt_tokens == greedy.usage.prompt_tokens
    check_idle(client, app)


def test_n_streamed_completions_seeded_equal_unstreamed(served) -> None:
    client, app, oai = served
    kw: dict[str, Any] = dict(model="tiny", prompt=PROMPT, max_tokens=8, n=4, seed=3)
    done = oai.completions.create(**kw)
    parts: dict[int, str] = {}
    for chunk in oai.completions.create(stream=True, **kw):
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + c.text
    assert parts == {c.index: c.text for c in done.choices}
    check_idle(client, app)


def test_n_past_the_bound_and_best_of_are_400s(served) -> None:
    import openai

    _, _, oai = served
    with pytest.raises(openai.BadRequestError, match="n=17 choices, at most 16"):
        oai.completions.create(model="tiny", prompt="hi", n=17)
    with pytest.raises(openai.BadRequestError, match="best_of=4 with n=2 is not supported"):
        oai.completions.create(model="tiny", prompt="hi", n=2, best_of=4)
    done = oai.completions.create(model="tiny", prompt="hi", n=2, best_of=2, max_tokens=2)
    assert len(done.choices) == 2
