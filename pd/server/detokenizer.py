"""Token ids in, text deltas out, with stop strings applied.

Used by the HTTP server and by the in-process engine's Python API, so nothing here knows about
FastAPI. Three pieces:

- ``IncrementalDetokenizer``: decodes a growing id sequence into text deltas without ever
  emitting half of a multi-byte character (the prefix-offset / read-offset technique).
- ``StopChecker``: finds stop strings in a stream of text deltas (a stop string may span
  deltas), truncates there, and holds back a tail that could still grow into a stop string.
- ``TextStream``: the two chained, driven by ``step(new_token_ids, finished)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from pd.core.sampling_params import SamplingParams

# Ids of the prompt tail decoded along with the first output tokens, so tokenizers that merge
# or strip leading spaces (sentencepiece) see the same context as a full decode would.
_NUM_PROMPT_CONTEXT_IDS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Decodes ids one step at a time; the concatenated deltas plus ``flush()`` equal
    ``tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``
    for byte-level BPE tokenizers.

    Offsets into ``token_ids`` (prompt context first, then outputs):

        [prefix_offset, read_offset)  already emitted; decoded again only as context
        [read_offset, len)            not yet emitted

    A step's delta is ``decode[prefix_offset:] minus decode[prefix_offset:read_offset]``; while
    it ends in U+FFFD the last character is incomplete, so nothing is emitted and the offsets
    stay until a later token completes it.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_ids[-_NUM_PROMPT_CONTEXT_IDS:])
        self._num_context_ids = len(self.token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self.token_ids)
        self.text = ""  # everything emitted so far

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self._num_context_ids :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

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
        if self._read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset :])
        if not force and (
            len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR)
        ):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]


class StopCheck(NamedTuple):
    text: str  # safe to emit now
    stop_str: str | None  # the stop string that ended the text, or None


class StopChecker:
    """Applies stop strings to a stream of text deltas.

    The text stops at the first point where any stop string ends (what a token-by-token engine
    would see first); if two end there, the longer one wins. The output is truncated before the
    stop string, or after it with ``include_stop_str_in_output``. While streaming, the longest
    tail that is a proper prefix of some stop string is held back, since the next delta may
    complete it; ``flush()`` releases it when generation ends without a stop.
    """

    def __init__(self, stop: Sequence[str], *, include_stop_str_in_output: bool = False) -> None:
        assert all(stop), f"stop strings must be non-empty, got {list(stop)!r}"
        self._stop = tuple(stop)
        self._include = include_stop_str_in_output
        self._held = ""
        self.stop_str: str | None = None

    @property
    def is_stopped(self) -> bool:
        return self.stop_str is not None

    def step(self, delta: str) -> StopCheck:
        assert not self.is_stopped, "step() after a stop string was found"
        if not self._stop:
            return StopCheck(delta, None)
        buf = self._held + delta
        match = self._first_match(buf)
        if match is not None:
            start, stop_str = match
            self.stop_str = stop_str
            self._held = ""
            end = start + len(stop_str) if self._include else start
            return StopCheck(buf[:end], stop_str)
        num_held = self._num_held(buf)
        self._held = buf[len(buf) - num_held :]
        return StopCheck(buf[: len(buf) - num_held], None)

    def flush(self) -> str:
        text, self._held = self._held, ""
        return text

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, -len, stop_str)
        for s in self._stop:
            start = buf.find(s)
            if start >= 0 and (best is None or (start + len(s), -len(s)) < best[:2]):
                best = (start + len(s), -len(s), s)
        return None if best is None else (best[0] + best[1], best[2])

    def _num_held(self, buf: str) -> int:
        longest = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(buf)), longest, -1):
                if buf.endswith(s[:k]):
                    longest = k
                    break
        return longest


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
