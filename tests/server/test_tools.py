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
