"""Tool calls on a chat stream: one choice's text deltas in, OpenAI's ``delta.content`` and
``delta.tool_calls`` out, as vLLM streams them; what they add up to is what ``Tools.parse``
reads out of the whole answer.

1. Outside a ``<tool_call>`` block, text streams as content as it comes, less a tail that may
   be the start of ``<tool_call>`` (held until it is not) and less whitespace around calls
   (``parse`` strips it too; an answer without calls keeps all of its text).
2. In a block, a call is announced once its head ``{"name": "...", "arguments": `` is in and
   names a tool: ``{"index", "id", "type": "function", "function": {"name", "arguments": ""}}``;
   then its arguments stream as the model writes them (``{"index", "function": {"arguments":
   piece}}``), up to the ``}`` that closes them: the text ``parse`` gives as ``arguments``.
   A block of another layout (arguments first, say) is held to its ``</tool_call>`` and
   announced whole; a block that is not a call streams as content then.
3. With ``tool_choice: auto``, an answer that opens with ``{`` may be one Llama-3 call: it is
   held to its end and read by ``parse``.
4. ``is_called``: a call's block closed and parsed, so the last chunk's ``finish_reason`` is
   ``"tool_calls"``. A call cut off by ``max_tokens`` was announced but is not done: the
   answer keeps ``finish_reason: "length"``.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

from pd.server.openai.tools import CALL_CLOSE, CALL_OPEN, JsonEnd, ToolCall, Tools, arguments_head


class ChoiceDelta(NamedTuple):
    content: str  # "" when none
    tool_calls: list[dict[str, Any]]  # OpenAI's ``delta.tool_calls`` entries, by call index


class _Mode(enum.Enum):
    START = "start"  # only whitespace so far
    TEXT = "text"  # outside a block
    HEAD = "head"  # in a block, before its call is known
    ARGS = "args"  # streaming a call's arguments
    TAIL = "tail"  # after the arguments, before ``</tool_call>``
    WHOLE = "whole"  # an answer held to its end (maybe a Llama-3 call)


class ToolCallStream:
    """One choice's answer read as it streams (see the module's docstring)."""

    def __init__(self, tools: Tools) -> None:
        self.tools = tools
        self._text = ""  # the answer so far
        self._pos = 0  # how much of it is read
        self._block = 0  # where the current block's body starts
        self._mode = _Mode.START
        self._args_end: JsonEnd | None = None  # the arguments' scan, in ARGS
        self._pending_space = ""  # content whitespace held: it may end the content
        self._num_calls = 0  # announced
        self._num_done = 0  # closed and parsed
        self._content: list[str] = []
        self._calls: list[dict[str, Any]] = []
        self._is_over = False

    @property
    def is_called(self) -> bool:
        return self._num_done > 0

    def feed(self, text: str, is_last: bool) -> ChoiceDelta:
        """The next piece of the answer -> what the client is sent for it; ``is_last``: the
        answer ends here (whatever is held goes out)."""
        assert not self._is_over, "fed past the answer's last piece"
        self._is_over = is_last
        self._text += text
        self._advance(is_last)
        if is_last:
            self._finish()
        out = ChoiceDelta("".join(self._content), self._calls)
        self._content, self._calls = [], []
        return out

    def _advance(self, is_last: bool) -> None:
        text = self._text
        while True:
            mode = self._mode
            if mode is _Mode.START:
                rest = text[self._pos :].lstrip()
                if not rest:
                    return
                is_json = rest[0] == "{" and not self.tools.is_forced
                self._mode = _Mode.WHOLE if is_json else _Mode.TEXT
            elif mode is _Mode.TEXT:
                at = text.find(CALL_OPEN, self._pos)
                if at < 0:
                    held = 0 if is_last else _partial_tail(text[self._pos :], CALL_OPEN)
                    self._add_content(text[self._pos : len(text) - held])
                    self._pos = len(text) - held
                    return
                self._add_content(text[self._pos : at])
                self._pos = self._block = at + len(CALL_OPEN)
                self._mode = _Mode.HEAD
            elif mode is _Mode.HEAD:
                close = text.find(CALL_CLOSE, self._block)
                head = arguments_head(text, self._block)
                if head is not None and head[0] in self.tools.functions:
                    name, args_at = head
                    if close < 0 or args_at <= close:
                        self._announce(ToolCall(name, ""))
                        self._args_end = JsonEnd()
                        self._pos = args_at
                        self._mode = _Mode.ARGS
                        continue
                if close < 0:
                    return
                self._close_block(close)
            elif mode is _Mode.ARGS:
                assert self._args_end is not None
                end = self._args_end.scan(text, self._pos)
                self._add_arguments(text[self._pos : len(text) if end is None else end])
                if end is None:
                    self._pos = len(text)
                    return
                self._pos = end
                self._mode = _Mode.TAIL
            elif mode is _Mode.TAIL:
                close = text.find(CALL_CLOSE, self._pos)
                if close < 0:
                    return
                if self.tools.call_of(text[self._block : close]) is not None:
                    self._num_done += 1
                self._pos = close + len(CALL_CLOSE)
                self._mode = _Mode.TEXT
            else:
                assert mode is _Mode.WHOLE, mode
                return

    def _close_block(self, close: int) -> None:
        """A block whose call was not announced, now whole: its call, else content."""
        call = self.tools.call_of(self._text[self._block : close])
        end = close + len(CALL_CLOSE)
        if call is None:
            self._add_content(self._text[self._block - len(CALL_OPEN) : end])
        else:
            self._announce(call)
            self._num_done += 1
        self._pos = end
        self._mode = _Mode.TEXT

    def _finish(self) -> None:
        text, mode = self._text, self._mode
        if mode is _Mode.WHOLE:
            content, calls = self.tools.parse(text)
            for call in calls:
                self._announce(call)
            self._num_done += len(calls)
            if content is not None:
                self._content.append(content)
            return
        if mode is _Mode.START:  # whitespace only: no call, so all of it
            self._content.append(text[self._pos :])
            return
        if mode is _Mode.HEAD:  # a block never closed is no call (``parse``): content
            self._add_content(text[self._block - len(CALL_OPEN) :])
        if self._num_calls == 0:
            self._content.append(self._pending_space)
        self._pending_space = ""
        self._mode = _Mode.TEXT

    def _add_content(self, piece: str) -> None:
        body = piece.rstrip()
        if not body:
            self._pending_space += piece
            return
        self._content.append(self._pending_space + body)
        self._pending_space = piece[len(body) :]

    def _announce(self, call: ToolCall) -> None:
        self._calls.append({"index": self._num_calls, **call.openai()})
        self._num_calls += 1

    def _add_arguments(self, piece: str) -> None:
        if not piece:
            return
        last = self._calls[-1] if self._calls else None
        if last is not None and last["index"] == self._num_calls - 1:
            last["function"]["arguments"] += piece
        else:
            self._calls.append({"index": self._num_calls - 1, "function": {"arguments": piece}})


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
