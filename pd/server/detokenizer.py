"""Token ids in, text deltas out, with stop strings applied.

Used by the HTTP server and by the in-process engine's Python API, so nothing here knows about
FastAPI. Three pieces:

- ``IncrementalDetokenizer``: decodes a growing id sequence into text deltas without ever
  emitting half of a multi-byte character (the prefix-offset / read-offset technique), at a
  bounded cost per id: ids that make no whole character are held back a few ids at most;
  its decodes go straight to a stock fast tokenizer's Rust backend (``backend_decoder``).
- ``StopChecker``: finds stop strings in a stream of text deltas (a stop string may span
  deltas), truncates there, and holds back a tail that could still grow into a stop string.
- ``TextStream``: the two chained, driven by ``step(new_token_ids, finished)``;
  ``open_text_stream`` builds one off the event loop when its stop strings are long.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import anyio

from pd.core.sampling_params import SamplingParams

# Ids of the prompt tail decoded along with the first output tokens, so tokenizers that merge
# or strip leading spaces (sentencepiece) see the same context as a full decode would.
_NUM_PROMPT_CONTEXT_IDS = 5
_REPLACEMENT_CHAR = "\ufffd"
# A character is at most 4 bytes and an id carries at least one, so this many held ids that
# still make no whole character are not waiting on one (a lone lead byte every step): their text
# goes out, U+FFFD for bytes that make no character, instead of being decoded again at every id.
_MAX_HELD_IDS = 6
_MAX_STOP_CHARS_ON_LOOP = 1024  # stop strings longer in all are compiled off the event loop


def backend_decoder(tokenizer: Any) -> Callable[[list[int], bool], str]:
    """``decode(ids, skip_special_tokens)`` equal to ``tokenizer.decode(ids,
    skip_special_tokens=..., clean_up_tokenization_spaces=False)``: for a transformers fast
    tokenizer whose class keeps the library's ``_decode`` (which then only calls its Rust
    backend), the backend's own ``decode``, without the Python layers around it that cost
    most of a call on a few ids (twice per streamed token); else the tokenizer's ``decode``."""
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    stock_decode, stock_inner = _stock_decodes()
    if backend is not None and getattr(cls, "decode", None) is stock_decode and (
        getattr(cls, "_decode", None) in stock_inner
    ):
        return backend.decode  # type: ignore[no-any-return]

    def decode(ids: list[int], skip_special_tokens: bool) -> str:
        return tokenizer.decode(  # type: ignore[no-any-return]
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    return decode


@functools.cache
def _stock_decodes() -> tuple[Any, frozenset[Any]]:
    """transformers' ``decode`` and its fast tokenizers' ``_decode`` (v5's
    ``TokenizersBackend``, v4's ``PreTrainedTokenizerFast``): on a list of ids, with
    ``clean_up_tokenization_spaces=False``, the two return ``self._tokenizer.decode(ids,
    skip_special_tokens=...)`` alone."""
    import transformers

    inner = set()
    for name in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        cls = getattr(transformers, name, None)
        if cls is not None:
            inner.add(cls._decode)
    return transformers.PreTrainedTokenizerBase.decode, frozenset(inner)


class IncrementalDetokenizer:
    """Decodes ids one step at a time; the concatenated deltas plus ``flush()`` equal
    ``tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``
    for byte-level BPE tokenizers, but where ``_MAX_HELD_IDS`` ids in a row end inside a
    character (skipped special tokens amid its bytes, or tokens that span characters, which
    SmolLM2's vocabulary has none of): that character comes out as U+FFFD.

    Offsets into ``token_ids`` (prompt context first, then outputs):

        [prefix_offset, read_offset)  already emitted; decoded again only as context
        [read_offset, len)            not yet emitted

    A step's delta is ``decode[prefix_offset:] minus decode[prefix_offset:read_offset]``; while
    it ends in U+FFFD the last character is incomplete, so nothing is emitted and the offsets
    stay until a later token completes it. A run of ``_MAX_HELD_IDS`` such ids is emitted up to
    its last id boundary that agrees with the full decode, U+FFFD for bytes that make no
    character (``_emit_held_run``). Both spans stay that short, so a step decodes a bounded
    number of ids however long the output is.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._backend_decode = backend_decoder(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_ids[-_NUM_PROMPT_CONTEXT_IDS:])
        self._num_context_ids = len(self.token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self.token_ids)
        self.text = ""  # everything emitted so far

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self._num_context_ids :]

    @property
    def num_held_ids(self) -> int:
        """Ids whose text is not emitted yet: at most ``_MAX_HELD_IDS - 1`` between steps."""
        return len(self.token_ids) - self._read_offset

    def _decode(self, ids: list[int]) -> str:
        return self._backend_decode(ids, self._skip_special_tokens)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add ids; return the text they complete (possibly "")."""
        delta = []
        for (
            token_id
        ) in new_token_ids:  # one at a time: a trailing partial char holds back only itself
            self.token_ids.append(token_id)
            delta.append(self._advance(force=False))
        text = "".join(delta)
        self.text += text
        return text

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character decodes to U+FFFD)."""
        text = self._advance(force=True)
        self.text += text
        return text

    def _advance(self, *, force: bool) -> str:
        if self.num_held_ids == 0:
            return ""
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset :])
        if force or (len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR)):
            return self._emit(new_text[len(prefix_text) :], len(self.token_ids))
        if self.num_held_ids < _MAX_HELD_IDS:
            return ""
        return self._emit_held_run(prefix_text, new_text)

    def _emit_held_run(self, prefix_text: str, new_text: str) -> str:
        """Emit a held run that makes no whole character: its text up to the last id boundary
        where it agrees with the run's settled text (all of ``new_text`` but a trailing U+FFFD,
        which later ids may still complete), so an incomplete character at its end stays held;
        all of it when no boundary agrees. Costs at most ``_MAX_HELD_IDS`` decodes."""
        settled = new_text[:-1] if new_text.endswith(_REPLACEMENT_CHAR) else new_text
        for end in range(len(self.token_ids) - 1, self._read_offset, -1):
            text = self._decode(self.token_ids[self._prefix_offset : end])
            if len(text) > len(prefix_text) and settled.startswith(text):
                return self._emit(text[len(prefix_text) :], end)
        return self._emit(new_text[len(prefix_text) :], len(self.token_ids))

    def _emit(self, text: str, end: int) -> str:
        """Mark the ids before ``end`` emitted as ``text``; they become the next context."""
        self._prefix_offset = self._read_offset
        self._read_offset = end
        return text


class StopCheck(NamedTuple):
    text: str  # safe to emit now
    stop_str: str | None  # the stop string that ended the text, or None


class StopAutomaton:
    """Aho–Corasick over a request's stop strings: fed one character at a time, it is always
    in the state of the longest suffix of the text so far that is a prefix of a stop string.

    ``goto[state]`` maps a character to the next state (a trie edge); ``fail[state]`` is the
    state of the longest proper suffix of the state's string that is in the trie; ``depth``
    the string's length; ``word[state]`` the longest stop string ending the state's string
    (the string itself, else ``word[fail[state]]``), or None. Feeding a character costs one
    edge plus the fail links taken; each fail link shortens the state, which grows by at most
    one per character, so a stream of n characters costs at most 2n steps, whatever the
    number and length of the stop strings. Building costs their total length, once.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        goto: list[dict[str, int]] = [{}]
        depth, word = [0], [None]  # type: list[int], list[str | None]
        for s in stop:
            state = 0
            for ch in s:
                edges = goto[state]
                nxt = edges.get(ch)
                if nxt is None:
                    nxt = edges[ch] = len(goto)
                    goto.append({})
                    depth.append(depth[state] + 1)
                    word.append(None)
                state = nxt
            word[state] = s
        fail = [0] * len(goto)
        queue = deque(goto[0].values())  # depth 1 fails to the root
        while queue:  # breadth first: a state's fail link is set before its children's
            state = queue.popleft()
            for ch, child in goto[state].items():
                queue.append(child)
                f = fail[state]
                while f and ch not in goto[f]:
                    f = fail[f]
                f = fail[child] = goto[f].get(ch, 0)
                if word[child] is None:
                    word[child] = word[f]
        self.goto, self.fail, self.depth, self.word = goto, fail, depth, word
        self.num_steps = 0  # edges and fail links taken so far: the work feeding cost

    def feed(self, state: int, text: str) -> tuple[int, int]:
        """Feed ``text`` from ``state``: the state after it and the number of characters fed,
        which stops right after the first character that ends a stop string."""
        goto, fail, word = self.goto, self.fail, self.word
        num_steps = 0
        for i, ch in enumerate(text):
            while (nxt := goto[state].get(ch)) is None and state:
                state = fail[state]
                num_steps += 1
            state = 0 if nxt is None else nxt
            num_steps += 1
            if word[state] is not None:
                self.num_steps += num_steps
                return state, i + 1
        self.num_steps += num_steps
        return state, len(text)


class StopChecker:
    """Applies stop strings to a stream of text deltas.

    The text stops at the first point where any stop string ends (what a token-by-token engine
    would see first); if two end there, the longer one wins. The output is truncated before the
    stop string, or after it with ``include_stop_str_in_output``. While streaming, the longest
    tail that is a proper prefix of some stop string is held back, since the next delta may
    complete it; ``flush()`` releases it when generation ends without a stop.

    A delta costs work in proportion to its length, not to the stop strings: only its
    characters are fed to the ``StopAutomaton`` (whose depth is the number of characters
    held), and the held tail is a queue of the deltas it came in, with an offset into the
    first, so a held character is copied once, when it is released.
    """

    def __init__(self, stop: Sequence[str], *, include_stop_str_in_output: bool = False) -> None:
        assert all(stop), f"stop strings must be non-empty, got {list(stop)!r}"
        self._automaton = StopAutomaton(stop) if stop else None
        self._include = include_stop_str_in_output
        self._state = 0  # the automaton's
        self._held: deque[str] = deque()  # the held tail, as the deltas it came in
        self._held_start = 0  # characters of _held[0] released already
        self._num_held = 0
        self.stop_str: str | None = None

    @property
    def is_stopped(self) -> bool:
        return self.stop_str is not None

    @property
    def num_steps(self) -> int:
        """Automaton steps taken so far: at most twice the characters fed."""
        return 0 if self._automaton is None else self._automaton.num_steps

    def step(self, delta: str) -> StopCheck:
        assert not self.is_stopped, "step() after a stop string was found"
        automaton = self._automaton
        if automaton is None:
            return StopCheck(delta, None)
        num_held = self._num_held
        self._state, num_fed = automaton.feed(self._state, delta)
        stop_str = automaton.word[self._state]
        if stop_str is not None:
            # it ends num_fed characters into the delta and starts in the held tail or the
            # delta: the part of it before the delta was a suffix of the text, so it was held
            self.stop_str = stop_str
            end = num_held + num_fed - (0 if self._include else len(stop_str))
            return StopCheck((self._release(num_held) + delta[:num_fed])[:end], stop_str)
        num_release = num_held + len(delta) - automaton.depth[self._state]
        if num_release <= num_held:
            text = self._release(num_release)
            self._hold(delta)
        else:
            text = self._release(num_held) + delta[: num_release - num_held]
            self._hold(delta[num_release - num_held :])
        return StopCheck(text, None)

    def flush(self) -> str:
        self._state = 0
        return self._release(self._num_held)

    def _hold(self, text: str) -> None:
        if text:
            self._held.append(text)
            self._num_held += len(text)

    def _release(self, num_chars: int) -> str:
        """The first ``num_chars`` held characters, no longer held."""
        parts = []
        self._num_held -= num_chars
        while num_chars:
            first, start = self._held[0], self._held_start
            if num_chars < len(first) - start:
                parts.append(first[start : start + num_chars])
                self._held_start += num_chars
                break
            parts.append(first[start:])
            num_chars -= len(first) - start
            self._held.popleft()
            self._held_start = 0
        return "".join(parts)


class TextDelta(NamedTuple):
    text: str  # text to emit for this step
    stop_str: str | None  # set once a stop string ended the text: the caller aborts the request


class TextStream:
    """Detokenizer + stop checker for one request.

    ``step(ids, finished)`` returns the text to emit. Once ``is_stopped`` the request must be
    aborted (the engine does not know about stop strings) and finished with reason "stop";
    further steps are not allowed. On ``finished=True`` everything held back is flushed.
    """

    def __init__(
        self,
        tokenizer: Any,
        params: SamplingParams,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens
        )
        self.stop_checker = StopChecker(
            params.stop, include_stop_str_in_output=params.include_stop_str_in_output
        )
        self.text = ""  # everything emitted so far

    @property
    def is_stopped(self) -> bool:
        return self.stop_checker.is_stopped

    def step(self, new_token_ids: Sequence[int], finished: bool = False) -> TextDelta:
        delta = self.detokenizer.step(new_token_ids)
        if finished:
            delta += self.detokenizer.flush()
        check = self.stop_checker.step(delta)
        text = check.text
        if finished and check.stop_str is None:
            text += self.stop_checker.flush()
        self.text += text
        return TextDelta(text, check.stop_str)

    def step_each(
        self, new_token_ids: Sequence[int], finished: bool = False
    ) -> tuple[TextDelta, int]:
        """``step`` over the ids one at a time; also returns how many of them the answer keeps:
        all, or those up to the one that completed a stop string. An answer then ends at the
        same token however the engine grouped them (a speculative step sends several)."""
        if len(new_token_ids) <= 1:
            return self.step(new_token_ids, finished), len(new_token_ids)
        texts: list[str] = []
        last = len(new_token_ids) - 1
        for i, token in enumerate(new_token_ids):
            delta = self.step((token,), finished and i == last)
            texts.append(delta.text)
            if delta.stop_str is not None:
                return TextDelta("".join(texts), delta.stop_str), i + 1
        return TextDelta("".join(texts), None), len(new_token_ids)


async def open_text_stream(
    tokenizer: Any, params: SamplingParams, prompt_ids: Sequence[int] = ()
) -> TextStream:
    """A ``TextStream``, built in a worker thread when its stop strings are long: compiling
    them costs time in proportion to their characters (RELIABILITY.md, stop strings at their
    limits), once per request, which the event loop should not pay while other streams wait."""
    if sum(len(s) for s in params.stop) <= _MAX_STOP_CHARS_ON_LOOP:
        return TextStream(tokenizer, params, prompt_ids)
    return await anyio.to_thread.run_sync(TextStream, tokenizer, params, prompt_ids)
