"""Tool calls on chat completions: ``tools`` and ``tool_choice`` -> what the chat template is
given, the grammar a required call is sampled under, and the answer's ``tool_calls``.

1. ``tool_choice`` (OpenAI's): ``"none"`` (the template is not given the tools, nothing is
   parsed), ``"auto"`` (the default with tools: the template is given them, and the answer's
   calls are parsed out when it makes some), ``"required"`` or a named function
   (``{"type": "function", "function": {"name": ...}}``): the answer is sampled under a grammar
   that admits only calls (of that function), so it always parses.
2. The calls are written as Hermes/Qwen blocks, ``<tool_call>\\n{"name": ..., "arguments":
   {...}}\\n</tool_call>``, one after another; ``parse`` also reads a Llama-3 answer that is
   one JSON object ``{"name": ..., "parameters": {...}}``.
3. An answer with calls has ``finish_reason: "tool_calls"``, each call's ``arguments`` the
   JSON text of its arguments (the model's own text where the block opens with its name,
   ``{"name": ..., "arguments": {...``: what a stream sends as it comes,
   ``pd.server.openai.tool_stream``), and the text outside the blocks (if any) as its content.
4. An assistant's ``tool_calls`` sent back in the conversation go to the chat template; a
   template with no place for them (one that never names ``tool_calls``: SmolLM2's) gets them
   as those blocks in the assistant's content (``calls_as_content``), as the model wrote them.
   Nothing the client sent is dropped, and the calls count against the context like any text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance

from pd.server.http.errors import APIError
from pd.server.openai.structured import check_grammar_size

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# a call's head, up to the ``{`` that opens its arguments
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')
# json.dumps' layout, as chat templates show calls; fixed: a small model cannot pad a call
# with whitespace until max_tokens
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text

    def openai(self) -> dict[str, Any]:
        return {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class Tools:
    """A request's tools as checked, and its ``tool_choice``: ``auto``, ``required``, or the
    name of the one function it must call."""

    functions: Mapping[str, Mapping[str, Any]]  # name -> its parameters' JSON schema
    choice: str
    parallel: bool = True

    @classmethod
    def of(
        cls, tools: Sequence[Any] | None, tool_choice: Any, parallel: bool | None
    ) -> Tools | None:
        """The checked tools (None where nothing is to be parsed: no tools, or ``"none"``);
        APIError (400) for a malformed tool or choice."""
        if tools:
            check_grammar_size(tools, "tools")  # they become a grammar and a prompt
        functions = _functions(tools or [])
        if tool_choice is None:
            tool_choice = "auto" if functions else "none"
        if tool_choice == "none":
            return None
        if not functions:
            raise APIError(
                f"tool_choice={json.dumps(tool_choice)} needs tools", param="tool_choice"
            )
        if tool_choice in ("auto", "required"):
            return cls(functions, tool_choice, parallel is not False)
        name = _named(tool_choice)
        if name not in functions:
            raise APIError(
                f"tool_choice names {name!r}, which is not among the tools "
                f"({', '.join(sorted(functions))})",
                param="tool_choice",
            )
        return cls(functions, name, parallel is not False)

    @property
    def is_forced(self) -> bool:
        return self.choice != "auto"

    def grammar(self) -> str:
        """The grammar of an answer that is only calls (of the named function, or of any); ""
        for ``auto``."""
        if not self.is_forced:
            return ""
        names = list(self.functions) if self.choice == "required" else [self.choice]
        schema = {
            "x-guidance": _LAYOUT,
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": n}, "arguments": self.functions[n]},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for n in names
            ],
        }
        nl = json.dumps("\n")
        more = f" ({nl} call)*" if self.parallel else ""
        lark = (
            f"start: call{more}\n"
            f"call: {json.dumps('<tool_call>' + chr(10))} body {json.dumps(chr(10) + '</tool_call>')}\n"
            f"body: %json {json.dumps(schema)}\n"
        )
        return llguidance.LLMatcher.grammar_from_lark(lark)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the content left, the calls) of an answer: its ``<tool_call>`` blocks that name a
        tool, else the whole answer as one Llama-3 JSON call; no call: (text, []). Linear in
        the answer's length (``blocks``: no pattern that can backtrack over a model's output,
        which runs on the server's event loop)."""
        found = blocks(text)
        calls = []
        for _, body, _ in found:
            call = self._call(body, "arguments")
            if call is not None:
                calls.append(call)
        if calls:
            rest, at = [], 0
            for start, _, end in found:
                rest.append(text[at:start])
                at = end
            rest.append(text[at:])
            return "".join(rest).strip() or None, calls
        call = self._call(text.strip(), "parameters") or self._call(text.strip(), "arguments")
        return (None, [call]) if call is not None else (text, [])

    def call_of(self, block: str) -> ToolCall | None:
        """The call of a ``<tool_call>`` block's body, None when it is not one."""
        return self._call(block.strip(), "arguments")

    def _call(self, text: str, args_key: str) -> ToolCall | None:
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.functions:
            return None
        args = obj.get(args_key, {})
        if not isinstance(args, dict):
            return None
        head = arguments_head(text, 0) if args_key == "arguments" else None
        if head is not None and head[0] == obj["name"]:
            end = JsonEnd().scan(text, head[1])
            raw = text[head[1] : end] if end is not None else ""
            if end is not None and json.loads(raw) == args:
                return ToolCall(obj["name"], raw)  # as streamed
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def calls_as_content(
    messages: list[dict[str, Any]], template: str | None
) -> list[dict[str, Any]]:
    """``messages`` (``ChatMessage.template_dict``'s) as a chat template of source ``template``
    gets them: unchanged where it names ``tool_calls``, else each assistant's calls written
    after its content as ``<tool_call>`` blocks (the arguments' text as sent); APIError (400)
    for a call without a function's name and arguments."""
    if template is None or "tool_calls" in template:
        return messages
    out = []
    for i, m in enumerate(messages):
        if not m.get("tool_calls"):
            out.append(m)
            continue
        text = [m["content"]] if m["content"] else []
        for j, call in enumerate(m["tool_calls"]):
            fn = call.get("function") if isinstance(call, dict) else None
            name = fn.get("name") if isinstance(fn, dict) else None
            args = fn.get("arguments") if isinstance(fn, dict) else None
            if not isinstance(name, str) or not isinstance(args, str | dict):
                raise APIError(
                    f"messages[{i}].tool_calls[{j}] needs function.name (a string) and "
                    "function.arguments (JSON text)",
                    param="messages",
                )
            args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            head = json.dumps({"name": name}, ensure_ascii=False)[:-1]
            text.append(f'{CALL_OPEN}\n{head}, "arguments": {args}}}\n{CALL_CLOSE}')
        out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": "\n".join(text)})
    return out


def blocks(text: str) -> list[tuple[int, str, int]]:
    """Each ``<tool_call>`` block of ``text`` that closes, in order: (where it opens, its body
    stripped of whitespace, where it ends); a block runs to the first ``</tool_call>`` after
    its opening. Two ``str.find`` calls a block: linear in ``text``."""
    out: list[tuple[int, str, int]] = []
    at = text.find(CALL_OPEN)
    while at >= 0:
        body = at + len(CALL_OPEN)
        close = text.find(CALL_CLOSE, body)
        if close < 0:  # no block after this one closes either
            break
        end = close + len(CALL_CLOSE)
        out.append((at, text[body:close].strip(), end))
        at = text.find(CALL_OPEN, end)
    return out


def arguments_head(text: str, start: int) -> tuple[str, int] | None:
    """(the name, where the arguments' ``{`` is) of a call whose body starts at ``start``
    and opens ``{"name": ..., "arguments": {``; None until that much is in, or if it never
    will be."""
    m = _HEAD.match(text, start)
    if m is None:
        return None
    try:
        name = json.loads(m.group(1))
    except (ValueError, RecursionError):
        return None
    return name, m.end()


class JsonEnd:
    """Where a JSON object that starts at a known index ends, read as its text arrives."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def scan(self, text: str, start: int) -> int | None:
        """The index past the object's closing brace, if it is in ``text[start:]`` (the
        text before ``start`` was scanned already); None: not yet."""
        for i in range(start, len(text)):
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None


def _functions(tools: Sequence[Any]) -> dict[str, Mapping[str, Any]]:
    out: dict[str, Mapping[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not (
            isinstance(tool, Mapping) and tool.get("type") == "function" and isinstance(fn, Mapping)
        ):
            raise APIError(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}',
                param="tools",
            )
        name, params = fn.get("name"), fn.get("parameters", {"type": "object"})
        if not isinstance(name, str) or not name or not isinstance(params, Mapping):
            raise APIError(
                f"tools[{i}].function needs a non-empty name and an object of parameters",
                param="tools",
            )
        if name in out:
            raise APIError(f"two tools are named {name!r}", param="tools")
        out[name] = params
    return out


def _named(tool_choice: Any) -> str:
    fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not (isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function" and name):
        raise APIError(
            f"tool_choice must be none, auto, required or "
            f'{{"type": "function", "function": {{"name": ...}}}}; got {json.dumps(tool_choice)}',
            param="tool_choice",
        )
    return str(name)
