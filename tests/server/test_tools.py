"""``pd.server.openai.tools`` on its own: the checks of ``tools`` and ``tool_choice``, the parse of
Hermes/Qwen blocks and of a Llama-3 JSON call, and the grammar of a required call."""

from __future__ import annotations

import json

import pytest

from pd.executor.grammar import grammar_error
from pd.server.http.errors import APIError
from pd.server.openai.tools import Tools

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}


def test_auto_parses_hermes_blocks_and_a_llama3_call() -> None:
    tools = Tools.of([ADD, NOW], "auto", None)
    assert tools is not None and not tools.is_forced and tools.grammar() == ""
    text = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    text += '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    content, calls = tools.parse(text)
    assert content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2}),
        ("now", {}),
    ]
    content, calls = tools.parse('{"name": "add", "parameters": {"a": 3, "b": 4}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 3, "b": 4})
    ]
    # no call: an unknown name, broken JSON, plain text
    for text in ('{"name": "mul", "parameters": {}}', "<tool_call>{oops</tool_call>", "hello"):
        assert tools.parse(text) == (text, [])


def test_none_and_no_tools_parse_nothing() -> None:
    assert Tools.of([ADD], "none", None) is None
    assert Tools.of(None, None, None) is None
    assert Tools.of([], "none", None) is None


@pytest.mark.parametrize(
    ("tools", "choice", "says"),
    [
        ([ADD], {"type": "function", "function": {"name": "mul"}}, "not among the tools"),
        ([ADD], {"type": "function"}, "tool_choice must be"),
        ([ADD], "sometimes", "tool_choice must be"),
        (None, "required", "needs tools"),
        ([{"type": "retrieval"}], "auto", "tools[0] must be"),
        ([{"type": "function", "function": {"name": ""}}], "auto", "non-empty name"),
        ([ADD, ADD], "auto", "two tools are named"),
    ],
)
def test_malformed_tools_and_choices_are_400s_that_say_why(tools, choice, says) -> None:
    with pytest.raises(APIError) as err:
        Tools.of(tools, choice, None)
    assert err.value.status_code == 400 and says in err.value.message


def test_a_required_calls_grammar_admits_only_calls_of_the_tools() -> None:
    import llguidance.hf

    from pd.model.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    ll = llguidance.hf.from_tokenizer(tok)
    named = Tools.of([ADD, NOW], {"type": "function", "function": {"name": "add"}}, False)
    assert named is not None and grammar_error(named.grammar()) == ""

    def accepts(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(ll, grammar)
        ids = tok.encode(text, add_special_tokens=False)
        return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()

    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert accepts(named.grammar(), call)
    assert not accepts(named.grammar(), call.replace('"add"', '"now"'))  # named: add only
    assert not accepts(named.grammar(), call + "\n" + call)  # parallel_tool_calls=false
    assert not accepts(named.grammar(), call.replace('"a": 1', '"a": "1"'))  # the schema holds
    required = Tools.of([ADD, NOW], "required", None)
    assert required is not None
    now = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    assert accepts(required.grammar(), call + "\n" + now)
    assert not accepts(required.grammar(), "Sure. " + call)


@pytest.mark.timeout(60)
def test_the_parse_is_linear_in_a_hostile_answer() -> None:
    """A model forced (by a regex constraint, say) to write whitespace after ``<tool_call>``
    must not freeze the event loop that parses its answer: the pattern this replaced took
    seconds at 2,000 spaces and grew with their cube; 200,000 take milliseconds now."""
    import time

    tools = Tools.of([ADD], "auto", None)
    assert tools is not None
    for answer in (
        "<tool_call>" + " " * 200_000,  # never closes
        ("<tool_call>" + " " * 1_000) * 200 + "</tool_call>",  # opens again and again
        "x" + "\t\n " * 70_000 + "<tool_call>" + " \n" * 70_000 + "}</tool_call>",
    ):
        t0 = time.perf_counter()
        content, calls = tools.parse(answer)
        assert time.perf_counter() - t0 < 5.0
        assert calls == [] and content == answer


def test_an_answer_nested_past_the_json_parsers_depth_is_no_call() -> None:
    """``json.loads`` raises RecursionError, not ValueError, on deep nesting: no call (and no
    500), in a block and as a whole Llama-3 answer."""
    tools = Tools.of([ADD], "auto", None)
    assert tools is not None
    deep = '{"name": "add", "arguments": ' + "[" * 200_000 + "]" * 200_000 + "}"
    for answer in (f"<tool_call>{deep}</tool_call>", deep, "[" * 200_000):
        content, calls = tools.parse(answer)
        assert calls == [] and content == answer


def test_blocks_are_what_the_pattern_found() -> None:
    """The scan gives the blocks a ``<tool_call>\\s*(.*?)\\s*</tool_call>`` search gave: each
    to the first close after its opening, bodies stripped, an unclosed tail ignored."""
    import re

    from pd.server.openai.tools import blocks

    pattern = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
    for text in (
        "a<tool_call> x </tool_call>b<tool_call>\ny\n</tool_call>",
        "<tool_call><tool_call> inner </tool_call> </tool_call>",
        "<tool_call>open only",
        "<tool_call>a</tool_call><tool_call>b",
        "no blocks",
    ):
        assert [body for _, body, _ in blocks(text)] == pattern.findall(text), text
        rest = "".join(
            text[a:b]
            for a, b in zip(
                [0] + [e for *_, e in blocks(text)], [s for s, *_ in blocks(text)] + [len(text)]
            )
        )
        assert rest == pattern.sub("", text), text
