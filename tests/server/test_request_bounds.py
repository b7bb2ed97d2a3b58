"""What a request can make the server (and the nodes) compile or tokenize is bounded before the
work starts: a schema, regex, grammar or the tools past ``MAX_GRAMMAR_CHARS`` characters of
JSON is a 400 naming the field; the tools and the assistants' tool calls count against the
prompt's character bound like the messages' text. Nothing is queued."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from pd.server.openai.structured import MAX_GRAMMAR_CHARS

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

BIG_SCHEMA = {
    "type": "object",
    "properties": {f"field_{i:06d}": {"type": "integer"} for i in range(40_000)},
}
MSG = [{"role": "user", "content": "hi"}]


async def _chat(app: Any, **body: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        return await c.post("/v1/chat/completions", json={"messages": MSG, **body})


def _tool(name: str, description: str = "") -> dict[str, Any]:
    fn = {"name": name, "description": description, "parameters": {"type": "object"}}
    return {"type": "function", "function": fn}


async def test_a_schema_past_the_bound_is_a_400_before_it_compiles(make_app: Any) -> None:
    app, fake = make_app(output_ids=[100])
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": BIG_SCHEMA}}
    for field, value in (
        ("response_format", fmt),
        ("guided_json", BIG_SCHEMA),
        ("guided_regex", "a" * (MAX_GRAMMAR_CHARS + 1)),
    ):
        r = await _chat(app, **{field: value})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and f"at most {MAX_GRAMMAR_CHARS}" in err["message"]
    big_tools = [_tool("f", "x" * MAX_GRAMMAR_CHARS)]
    r = await _chat(app, tools=big_tools, tool_choice="required")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert fake.requests == []


async def test_tools_and_tool_calls_count_against_the_prompts_characters(make_app: Any) -> None:
    app, fake = make_app(output_ids=[100])
    # under the grammar bound, over the prompt's (the tiny test model's context is short)
    r = await _chat(app, tools=[_tool("f", "word " * 20_000)])
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
    call = {"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": '{"a": "' + "y" * 100_000 + '"}'}}  # fmt: skip
    messages = [*MSG, {"role": "assistant", "content": "", "tool_calls": [call]}]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        r = await c.post("/v1/chat/completions", json={"messages": messages})
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
    assert fake.requests == []


async def test_an_assistants_tool_calls_reach_the_prompt_where_the_template_drops_them(
    make_app: Any, tokenizer: Any
) -> None:
    """SmolLM2's template never names ``tool_calls``: the calls are written into the
    assistant's turn as the ``<tool_call>`` blocks this server parses from answers, so the
    model sees them and they count against the context (they were dropped: a call of ~350k
    characters got a 200 at SmolLM2's context of 8,192 tokens)."""
    assert "tool_calls" not in tokenizer.chat_template
    app, fake = make_app(output_ids=[100], max_model_len=8192)

    def conversation(arguments: str) -> list[dict[str, Any]]:
        call = {"id": "c1", "type": "function",
                "function": {"name": "lookup", "arguments": arguments}}  # fmt: skip
        return [
            *MSG,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        big = '{"a": "' + "y" * 349_000 + '"}'
        r = await c.post("/v1/chat/completions", json={"messages": conversation(big), "max_tokens": 4})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and "8192" in err["message"], err
        assert fake.requests == []
        r = await c.post(
            "/v1/chat/completions",
            json={"messages": conversation('{"word": "river"}'), "max_tokens": 4},
        )
        assert r.status_code == 200, r.text
        (_, prompt_ids, _), = fake.requests
        prompt = tokenizer.decode(prompt_ids)
        want = '<tool_call>\n{"name": "lookup", "arguments": {"word": "river"}}\n</tool_call>'
        assert f"<|im_start|>assistant\n{want}<|im_end|>" in prompt, prompt
        bad = conversation("{}")
        bad[1]["tool_calls"] = [{"id": "c1", "type": "function", "function": {"arguments": "{}"}}]
        r = await c.post("/v1/chat/completions", json={"messages": bad, "max_tokens": 4})
        assert r.status_code == 400 and "tool_calls[0]" in r.json()["error"]["message"], r.text
