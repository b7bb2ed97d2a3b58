"""``pd.server.openai.tool_stream`` on its own: an answer fed in pieces (whole, a character at a
time, random cuts) adds up to what ``Tools.parse`` reads out of it whole, each call's name in
its first delta and its arguments streamed as they come."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from pd.server.openai.tool_stream import ToolCallStream
from pd.server.openai.tools import Tools
from tests.server.test_tools import ADD, NOW

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
NOW_CALL = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
ANSWERS = [
    CALL,
    CALL + "\n" + NOW_CALL,
    "Sure.\n" + CALL + "\nDone.",
    '<tool_call>{"arguments": {"a": 5, "b": 6}, "name": "add"}</tool_call>',  # held whole
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": {"x": "}\\"{"}}}\n</tool_call>',
    '{"name": "add", "parameters": {"a": 3, "b": 4}}',  # a Llama-3 call
    '{"not": "a call"}',
    "Hello <tool and more text, no call.",
    "  leading space, no call  ",
    "<tool_call>{oops</tool_call> then text",
]


def _cuts(text: str, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    return [[text], list(text), pieces]


def _stream(tools: Tools, pieces: list[str]) -> tuple[str, list[dict[str, Any]], bool, int]:
    """(content, calls assembled as the openai SDK does, is_called, the deltas' count)."""
    s = ToolCallStream(tools)
    content, calls, num_deltas = "", [], 0
    for i, piece in enumerate(pieces):
        out = s.feed(piece, i == len(pieces) - 1)
        content += out.content
        for d in out.tool_calls:
            num_deltas += 1
            if d["index"] == len(calls):  # a new call: its id, type and name come first
                assert d["type"] == "function" and d["id"].startswith("call_"), d
                assert d["function"]["name"] in tools.functions, d
                calls.append({"name": d["function"]["name"], "arguments": ""})
            else:
                assert d["index"] == len(calls) - 1 and set(d) == {"index", "function"}, d
                assert set(d["function"]) == {"arguments"}, d
            calls[-1]["arguments"] += d["function"]["arguments"]
    return content, calls, s.is_called, num_deltas


@pytest.mark.parametrize("answer", ANSWERS)
def test_a_streamed_answer_adds_up_to_the_parsed_one_however_it_is_cut(answer: str) -> None:
    tools = Tools.of([ADD, NOW], "auto", None)
    assert tools is not None
    want_content, want_calls = tools.parse(answer)
    want = [{"name": c.name, "arguments": c.arguments} for c in want_calls]
    for pieces in _cuts(answer, seed=len(answer)):
        content, calls, is_called, _ = _stream(tools, pieces)
        assert calls == want, pieces
        assert (content or None) == want_content, pieces
        assert is_called == bool(want_calls)
    for call in want:
        json.loads(call["arguments"])


def test_arguments_stream_as_they_come_in_the_models_own_layout() -> None:
    tools = Tools.of([ADD, NOW], "required", None)
    assert tools is not None
    _, calls, is_called, num_deltas = _stream(tools, list(CALL))
    assert is_called and calls == [{"name": "add", "arguments": '{"a": 1, "b": 2}'}]
    # the head (with the arguments' "{"), then one delta per character
    assert num_deltas == len('{"a": 1, "b": 2}')
    # the model's own layout is kept, streamed or not
    raw = '<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>'
    assert tools.parse(raw)[1][0].arguments == '{"a":1,"b":2}'
    assert _stream(tools, list(raw))[1] == [{"name": "add", "arguments": '{"a":1,"b":2}'}]


def test_a_call_cut_off_by_max_tokens_is_announced_but_not_done() -> None:
    tools = Tools.of([ADD], "required", None)
    assert tools is not None
    cut = CALL[: CALL.index('"b"')]
    content, calls, is_called, _ = _stream(tools, list(cut))
    assert not is_called and content == ""
    assert calls == [{"name": "add", "arguments": '{"a": 1, '}]
    content, calls, is_called, _ = _stream(tools, ['Sure <tool_call>\n{"na'])
    assert not is_called and calls == [] and content == 'Sure <tool_call>\n{"na'  # as parse
