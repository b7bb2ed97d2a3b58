"""What a node sends again when the server asks (``ResendMsg``): a request's output from an offset.

A token frame can be lost between a node and the server (``ServerLink.send`` drops a frame the
socket would not take; a connection cut by the server's connection cap loses what it carried),
or the server can find a request silent for a while. The server then asks the node for the
request's output from the offset it has, and the node answers with one ``TokenMsg``
(``answer``):

- a request it runs: its output from that offset (its tokens and their logprobs are all on the
  ``Req``), maybe none yet; on a node that does not stream it (a prefill node hands the first
  token to the decode node), no tokens: it is still being prefilled;
- a request it holds without output yet (waiting, expected, its KV landing): no tokens;
- a request it finished: the tail of its output from ``RecentOutputs``, a bounded record of the
  last messages of recently finished requests (the last ``window`` tokens of each, their
  logprobs kept as msgpack bytes: ~16 KB for 64 tokens of ``top_logprobs=20``, ~100 KB as
  objects), bounded in count, age and bytes, so a lost final frame is sent again; its error,
  for one that failed;
- anything else (never known, or aged out of the record): ``is_unknown``, an error naming the
  tokens it cannot send, so the server ends the request at once instead of at its deadline.

A long answer goes in several messages (``split``), each well within a frame's size limit.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import msgspec

from pd.core.messages import ResendMsg, TokenLogprobsMsg, TokenMsg, token_bytes
from pd.core.request import Req

# An answer's tokens go in messages of at most this many bytes each (``token_bytes``), in
# order, the end on the last: far under any frame a server's socket takes, however long the
# output and its logprobs.
MAX_ANSWER_BYTES = 64 << 10


_LOGPROBS = msgspec.msgpack.Decoder(list[TokenLogprobsMsg])
_ENCODER = msgspec.msgpack.Encoder()
# what an entry of the record holds besides its logprobs' bytes: a Python int per token id
# and its list's pointer (36 bytes), the tuple, its strings and the dict's entry
_ID_BYTES, _ENTRY_BYTES = 36, 512


class Ended(NamedTuple):
    """A finished request's last ``window`` tokens (from ``offset``) and how it ended."""

    offset: int
    token_ids: list[int]
    logprobs: bytes  # msgpack of their list[TokenLogprobsMsg] (b"" without logprobs)
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None
    is_refused: bool
    can_retry: bool
    when: float


class RecentOutputs:
    """The ends of the last ``max_ids`` finished requests, each for ``max_age_s``, in at most
    ``max_bytes`` (``num_bytes``; the oldest go first), each its last ``window`` tokens:
    bounded whatever the node serves."""

    def __init__(
        self,
        max_ids: int = 4096,
        max_age_s: float = 120.0,
        window: int = 64,
        clock: Callable[[], float] = time.monotonic,
        max_bytes: int = 16 << 20,
    ) -> None:
        self.max_ids = max_ids
        self.max_age_s = max_age_s
        self.window = window
        self.max_bytes = max_bytes
        self._clock = clock
        self._ends: OrderedDict[str, Ended] = OrderedDict()  # oldest first
        self.num_bytes = 0  # what the entries hold (``_size``)

    def __len__(self) -> int:
        return len(self._ends)

    def add_finished(self, req: Req) -> None:
        """``req`` finished (its last tokens were just sent)."""
        # (a resumed request holds no logprobs for the output it came with)
        start = max(len(req.output_ids) - self.window, req.num_resumed)
        self._add(
            req.request_id,
            Ended(
                start,
                req.output_ids[start:],
                _ENCODER.encode(req.output_logprobs[start - req.num_resumed :])
                if req.output_logprobs
                else b"",
                req.finish_reason,
                req.num_prompt_tokens,
                reported_cached_tokens(req),
                req.error,
                req.is_refused,
                False,
                self._clock(),
            ),
        )

    def add_error(self, msg: TokenMsg) -> None:
        """A request failed here with ``msg`` (it holds no tokens)."""
        ended = Ended(msg.offset, [], b"", msg.finish_reason, msg.num_prompt_tokens,
                      msg.num_cached_tokens, msg.error, msg.is_refused, msg.can_retry,
                      self._clock())  # fmt: skip
        self._add(msg.request_id, ended)

    def _add(self, request_id: str, ended: Ended) -> None:
        old = self._ends.pop(request_id, None)
        if old is not None:
            self.num_bytes -= _size(old)
        self._ends[request_id] = ended
        self.num_bytes += _size(ended)
        self._expire()

    def get(self, request_id: str) -> Ended | None:
        self._expire()
        return self._ends.get(request_id)

    def _expire(self) -> None:
        limit = self._clock() - self.max_age_s
        while self._ends and (
            len(self._ends) > self.max_ids
            or self.num_bytes > self.max_bytes
            or next(iter(self._ends.values())).when < limit
        ):
            self.num_bytes -= _size(self._ends.popitem(last=False)[1])


def _size(ended: Ended) -> int:
    """About the bytes an entry holds (its logprobs' msgpack, its ids as Python ints, its
    error's text)."""
    num_ids = len(ended.token_ids)
    return len(ended.logprobs) + _ID_BYTES * num_ids + len(ended.error or "") + _ENTRY_BYTES


def answer(
    msg: ResendMsg,
    live: Req | None,
    is_held: bool,
    streams: bool,
    recent: RecentOutputs,
    node_id: str,
) -> TokenMsg:
    """The answer to ``msg``: ``live`` is the request if the node's scheduler runs or queues it,
    ``is_held`` whether the role holds it otherwise (expected, its KV landing, its transfer
    going), ``streams`` whether this node streams its tokens (a decode node)."""
    rid, start = msg.request_id, msg.from_offset
    if live is not None or is_held:
        n = len(live.output_ids) if live is not None and streams else 0
        # no output here (yet), or not from here (one resumed here holds no logprobs for the
        # output it came with, which the server has)
        if live is None or not streams or not live.num_resumed <= start <= n:
            return _token_msg(rid, node_id, min(start, n), [], [], live)
        lp_start = start - live.num_resumed
        logprobs = live.output_logprobs[lp_start:] if live.output_logprobs else []
        return _token_msg(rid, node_id, start, live.output_ids[start:], logprobs, live)
    ended = recent.get(rid)
    if ended is not None and ended.error is not None:
        return TokenMsg(request_id=rid, offset=ended.offset, token_ids=[], finished=True,
                        finish_reason=ended.finish_reason, num_prompt_tokens=0,
                        num_cached_tokens=0, error=ended.error, node_id=node_id,
                        can_retry=ended.can_retry, is_refused=ended.is_refused)  # fmt: skip
    end = 0 if ended is None else ended.offset + len(ended.token_ids)
    if ended is None or not ended.offset <= start <= end:
        held = "" if ended is None else f" (it keeps tokens {ended.offset}-{end} of its output)"
        why = (f"node {node_id} cannot send tokens from offset {start} of request {rid} "
               f"again: they were lost on the way to the server, and it no longer holds them"
               f"{held}")  # fmt: skip
        return TokenMsg(request_id=rid, offset=start, token_ids=[], finished=True,
                        finish_reason="abort", num_prompt_tokens=0, num_cached_tokens=0,
                        error=why, node_id=node_id, is_unknown=True)  # fmt: skip
    i = start - ended.offset
    return TokenMsg(request_id=rid, offset=start, token_ids=ended.token_ids[i:],
                    logprobs=_LOGPROBS.decode(ended.logprobs)[i:] if ended.logprobs else [],
                    finished=True,
                    finish_reason=ended.finish_reason, num_prompt_tokens=ended.num_prompt_tokens,
                    num_cached_tokens=ended.num_cached_tokens, node_id=node_id)  # fmt: skip


def split(msg: TokenMsg, max_bytes: int = MAX_ANSWER_BYTES) -> list[TokenMsg]:
    """``msg`` as consecutive messages of at most ``max_bytes`` of tokens each (at least one
    token each), its end on the last."""
    parts: list[TokenMsg] = []
    start, n = 0, len(msg.token_ids)
    lps = msg.logprobs
    while True:
        end, size = start + 1, token_bytes(1, lps[start : start + 1])
        while end < n:
            size += token_bytes(1, lps[end : end + 1]) - token_bytes(0, [])  # one more token
            if size > max_bytes:
                break
            end += 1
        end = min(end, n)
        last = end >= n
        part = msgspec.structs.replace(
            msg,
            offset=msg.offset + start,
            token_ids=msg.token_ids[start:end],
            logprobs=msg.logprobs[start:end],
            finished=msg.finished and last,
            finish_reason=msg.finish_reason if last else None,
        )
        parts.append(part)
        if last:
            return parts
        start = end


def _token_msg(
    rid: str,
    node_id: str,
    offset: int,
    token_ids: list[int],
    logprobs: list[TokenLogprobsMsg],
    req: Req | None,
) -> TokenMsg:
    """A live request's output from ``offset`` (it has not finished: a finished one is
    answered from the record, with its end)."""
    return TokenMsg(
        request_id=rid,
        offset=offset,
        token_ids=token_ids,
        logprobs=logprobs,
        finished=False,
        finish_reason=None,
        num_prompt_tokens=0 if req is None else req.num_prompt_tokens,
        num_cached_tokens=0 if req is None else reported_cached_tokens(req),
        node_id=node_id,
    )


def reported_cached_tokens(req: Req) -> int:
    """The prompt tokens a cache served, as the request's first token message said."""
    n = req.num_reported_cached_tokens
    return req.num_cached_tokens if n < 0 else n
