"""Structured outputs through the HTTP API with the official openai client, over the colocated
engine with SmolLM2-135M-Instruct under uvicorn on loopback: ``beta.chat.completions.parse``
with a Pydantic model returns a parsed object for every prompt (issue 44's acceptance), vLLM's
``guided_*`` fields hold on completions and chat, and a schema llguidance cannot compile is a
400 that says why, with nothing queued. Tool calls streamed (plain ``stream=True`` with ``n``,
and the SDK's ``chat.completions.stream`` helper) add up to the non-streamed answer, and the
streamed ``parse`` form parses. The ``check_*`` functions run against a live cluster too
(``tests/cluster/test_e2e.py``)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import check_idle, colocated_app, serve

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


class City(BaseModel):
    country: str = Field(max_length=16)
    coastal: bool
    size: Literal["small", "medium", "large"]


CITIES = [
    "Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Sydney", "Toronto", "Mumbai", "Rome",
]  # fmt: skip


@pytest.fixture(scope="module")
def served(smollm2_dir: Path) -> Iterator[tuple[Any, Any, Any]]:
    """(the AsyncEngine, the app, an openai client of the server)."""
    from openai import OpenAI

    client, app = colocated_app(smollm2_dir, max_total_tokens=4096)
    with serve(app) as url:
        yield (
            client,
            app,
            OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120),
        )
    client.shutdown()


def test_parse_returns_a_parsed_object_for_ten_prompts(served) -> None:
    client, app, oai = served
    check_parse_ten_prompts(oai, "tiny")
    check_idle(client, app)


def check_parse_ten_prompts(oai: openai.OpenAI, model: str) -> None:
    """Ten requests at once (they share the engine's batches: the masks of many rows a step)."""

    def parse(city: str) -> Any:
        return oai.beta.chat.completions.parse(
            model=model,
            messages=[{"role": "user", "content": f"Describe the city of {city} as JSON."}],
            response_format=City,
            max_tokens=48,
            temperature=0.0,
        )

    with ThreadPoolExecutor(len(CITIES)) as pool:
        answers = list(pool.map(parse, CITIES))
    for done in answers:
        choice = done.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, City), choice.message


def test_guided_fields_hold_on_completions_and_chat_streamed_or_not(served) -> None:
    client, app, oai = served
    choices = ["red", "green", "blue"]
    done = oai.completions.create(
        model="tiny",
        prompt="My favourite colour is",
        max_tokens=8,
        extra_body={"guided_choice": choices},
    )
    assert done.choices[0].text in choices and done.choices[0].finish_reason == "stop"
    stream = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Give me a phone number."}],
        max_tokens=24,
        stream=True,
        extra_body={"structured_outputs": {"regex": r"\+1-[0-9]{3}-[0-9]{4}"}},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert re.fullmatch(r"\+1-[0-9]{3}-[0-9]{4}", text), text
    done = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Any JSON object, please."}],
        max_tokens=48,
        temperature=0.7,
        seed=3,
        response_format={"type": "json_object"},
    )
    if done.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(done.choices[0].message.content), dict)
    else:  # cut by max_tokens: a prefix of an object
        assert done.choices[0].message.content.startswith("{")
    check_idle(client, app)


def test_a_schema_that_does_not_compile_is_a_400_that_says_why(served) -> None:
    from openai import BadRequestError

    client, app, oai = served
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integr"}}}
    with pytest.raises(BadRequestError) as err:
        oai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            response_format=bad,  # type: ignore[arg-type]
        )
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == "response_format", body
    assert "does not compile" in body["message"] and "integr" in body["message"], body
    check_idle(client, app)


def test_a_grammar_over_the_engines_budget_is_a_400_streamed_or_not(served) -> None:
    """Issue 55, item 2: a grammar the engine refuses (here over a size budget lowered for the
    test: ``--max-grammar-chars``) ends its request with a 400 in OpenAI's shape, or an
    ``invalid_request_error`` event on a stream, not a 500; the engine goes on."""
    from openai import BadRequestError

    client, app, oai = served
    # a schema no other test sends: its grammar is not in the engine's cache of compiled ones
    schema = {"type": "object", "properties": {"budget_test": {"type": "integer"}}}
    budget = client.call(lambda engine: engine.core.grammars.max_chars)
    client.call(lambda engine: setattr(engine.core.grammars, "max_chars", 64))
    try:
        with pytest.raises(BadRequestError) as err:
            oai.completions.create(
                model="tiny",
                prompt="A city:",
                max_tokens=4,
                n=2,
                extra_body={"guided_json": schema},
            )
        body = err.value.body
        assert isinstance(body, dict) and body["type"] == "invalid_request_error", body
        assert "this engine compiles grammars of at most 64" in body["message"], body
        stream = oai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            stream=True,
            extra_body={"guided_json": schema},
        )
        with pytest.raises(openai.APIError) as streamed:
            list(stream)
        assert "at most 64" in str(streamed.value), streamed.value
    finally:
        client.call(lambda engine: setattr(engine.core.grammars, "max_chars", budget))
    check_idle(client, app)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
        },
    },
}


def test_tool_choice_required_returns_a_parsed_call_for_ten_prompts(served) -> None:
    client, app, oai = served
    check_required_tool_calls_ten_prompts(oai, "tiny")
    check_idle(client, app)


def check_required_tool_calls_ten_prompts(oai: openai.OpenAI, model: str) -> None:
    """SmolLM2's template shows no tools: only the grammar makes these answers calls."""

    def ask(city: str) -> Any:
        return oai.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"What is the weather in {city}?"}],
            tools=[WEATHER, TIME],  # type: ignore[list-item]
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=64,
            temperature=0.0,
        )

    with ThreadPoolExecutor(len(CITIES)) as pool:
        answers = list(pool.map(ask, CITIES))
    for done in answers:
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in ("get_weather", "get_time")
        args = json.loads(call.function.arguments)
        assert set(args) == ({"city", "unit"} if call.function.name == "get_weather" else {"zone"})


def test_a_named_tool_choice_calls_that_function_and_none_calls_nothing(served) -> None:
    client, app, oai = served
    messages = [{"role": "user", "content": "What time is it in Paris?"}]
    named = oai.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=48,
        temperature=0.0,
    )
    calls = named.choices[0].message.tool_calls
    assert named.choices[0].finish_reason == "tool_calls" and calls
    assert all(c.function.name == "get_time" for c in calls)
    none = oai.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice="none",
        max_tokens=4,
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    check_idle(client, app)


class GetWeather(BaseModel):
    """The weather in a city"""

    city: str = Field(max_length=16)
    unit: Literal["celsius", "fahrenheit"]


def test_streamed_tool_calls_equal_the_non_streamed_ones(served) -> None:
    client, app, oai = served
    check_streamed_tool_calls(oai, "tiny")
    check_idle(client, app)


def test_the_sdks_stream_helpers_parse_streamed_calls_and_objects(served) -> None:
    client, app, oai = served
    check_stream_helpers(oai, "tiny")
    check_idle(client, app)


def check_streamed_tool_calls(oai: openai.OpenAI, model: str) -> None:
    """``stream=True`` with ``tool_choice`` required (n=2, by choice index) and named: each
    call's id, type and name in its first delta, its arguments in pieces after, and what they
    add up to is the non-streamed greedy answer; ``finish_reason: "tool_calls"``. ``auto``
    (SmolLM2 answers in words) streams the non-streamed content and no call. All at once."""
    weather: Any = [{"role": "user", "content": "What is the weather in Oslo?"}]
    time: Any = [{"role": "user", "content": "What time is it in Paris?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    cases = [
        dict(messages=weather, tool_choice="required", n=2),
        dict(messages=time, tool_choice=named, n=1),
    ]
    common: dict[str, Any] = dict(
        model=model,
        tools=[WEATHER, TIME],
        parallel_tool_calls=False,  # one call, then the end (not calls until max_tokens)
        max_tokens=64,
        temperature=0.0,
    )
    auto: dict[str, Any] = dict(
        model=model, messages=weather, tools=[WEATHER], max_tokens=16, temperature=0.0
    )
    with ThreadPoolExecutor(2 * len(cases) + 2) as pool:
        dones = [pool.submit(oai.chat.completions.create, **common, **c) for c in cases]
        streams = [pool.submit(_streamed_calls, oai, {**common, **c}) for c in cases]
        auto_done = pool.submit(oai.chat.completions.create, **auto)
        auto_chunks = pool.submit(lambda: list(oai.chat.completions.create(stream=True, **auto)))
    for case, done_f, stream_f in zip(cases, dones, streams):
        done = done_f.result()
        assert all(c.finish_reason == "tool_calls" for c in done.choices), done
        want = [(c.function.name, c.function.arguments) for c in done.choices[0].message.tool_calls]
        calls, finish, num_pieces = stream_f.result()
        assert finish == {i: "tool_calls" for i in range(case["n"])}, finish
        for i in range(case["n"]):
            assert [(c["name"], c["arguments"]) for c in calls[i]] == want, (i, calls)
        assert num_pieces > case["n"], num_pieces  # the arguments came in pieces
    done = auto_done.result()
    assert done.choices[0].message.tool_calls is None, done
    chunks = auto_chunks.result()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == done.choices[0].message.content
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)


def _streamed_calls(
    oai: openai.OpenAI, kw: dict[str, Any]
) -> tuple[dict[int, list[dict[str, Any]]], dict[int, str], int]:
    """(each choice's calls as the SDK's helpers assemble them, each choice's finish reason,
    the number of argument pieces after the first delta of each call) of a stream."""
    calls: dict[int, list[dict[str, Any]]] = {i: [] for i in range(kw["n"])}
    finish: dict[int, str] = {}
    num_pieces = 0
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            assert not c.delta.content, c  # only calls under a grammar of calls
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
            for d in c.delta.tool_calls or []:
                made = calls[c.index]
                if d.index == len(made):  # a new call: id, type and name come first
                    assert d.id and d.id.startswith("call_") and d.type == "function", d
                    assert d.function is not None and d.function.name, d
                    made.append({"name": d.function.name, "arguments": ""})
                else:
                    assert d.index == len(made) - 1 and d.id is None, d
                    assert d.function is not None and d.function.name is None, d
                    num_pieces += 1
                made[-1]["arguments"] += d.function.arguments or ""
    return calls, finish, num_pieces


def check_stream_helpers(oai: openai.OpenAI, model: str) -> None:
    """``client.chat.completions.stream`` with a strict Pydantic tool and tool_choice
    required: its events carry the arguments' pieces, and its final completion's call has
    ``parsed_arguments``, the non-streamed ``parse``'s; ``beta.chat.completions.stream`` with
    ``response_format=City`` gives the parsed object. All at once."""
    kw: dict[str, Any] = dict(
        model=model,
        messages=[{"role": "user", "content": "Is it cold in Lima?"}],
        max_tokens=64,
        temperature=0.0,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    city_kw: dict[str, Any] = dict(
        model=model,
        messages=[{"role": "user", "content": "Describe the city of Rome as JSON."}],
        max_tokens=48,
        temperature=0.0,
        response_format=City,
    )

    def streamed(helper: Any, **kw: Any) -> tuple[list[str], Any]:
        with helper(**kw) as stream:
            return [event.type for event in stream], stream.get_final_completion()

    with ThreadPoolExecutor(3) as pool:
        done_f = pool.submit(oai.chat.completions.parse, **kw)
        tool_f = pool.submit(streamed, oai.chat.completions.stream, **kw)
        city_f = pool.submit(streamed, oai.beta.chat.completions.stream, **city_kw)
    (want,) = done_f.result().choices[0].message.tool_calls or []
    assert isinstance(want.function.parsed_arguments, GetWeather), want
    kinds, final = tool_f.result()
    assert kinds.count("tool_calls.function.arguments.delta") > 1, kinds
    assert kinds.count("tool_calls.function.arguments.done") == 1, kinds
    (call,) = final.choices[0].message.tool_calls or []
    assert final.choices[0].finish_reason == "tool_calls"
    assert call.function.parsed_arguments == want.function.parsed_arguments
    assert call.function.arguments == want.function.arguments
    kinds, final = city_f.result()
    assert kinds.count("content.delta") > 1, kinds
    assert isinstance(final.choices[0].message.parsed, City), final
