"""A request's state inside one engine or node (plain Python), and its status.

The status says where the request is; ``Req.set_status`` is the one place that changes it and
refuses a move the table below does not allow (``InvalidTransition``, with both states):

    NEW -> WAITING     added to a scheduler's queue (the colocated engine, either role)
    NEW -> EXPECTED    decode node: announced by the server, its KV still to come
    WAITING -> RUNNING admitted: its slots locked or allocated; prefilling, then decoding
    RUNNING -> WAITING retracted for want of slots (it resumes by recomputing what was evicted)
    RUNNING -> SENDING prefill node: first token sampled, its KV on the wire to the decode node
    EXPECTED -> INCOMING   decode node: slots reserved, the KV landing in them
    INCOMING -> RUNNING    decode node: the KV is in and the first token came: it decodes
    INCOMING -> RELEASING  decode node: aborted while its KV lands; its slots go back once no
                           data thread can write them (-> FINISHED)
    any but FINISHED -> FINISHED   done, aborted or failed (``finish_reason`` says which)
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from pd.core.messages import TokenLogprobsMsg
from pd.core.sampling_params import SamplingParams


class ReqStatus(enum.Enum):
    NEW = "new"
    WAITING = "waiting"
    RUNNING = "running"
    SENDING = "sending"
    EXPECTED = "expected"
    INCOMING = "incoming"
    RELEASING = "releasing"
    FINISHED = "finished"


_S = ReqStatus
ALLOWED_TRANSITIONS: dict[ReqStatus, frozenset[ReqStatus]] = {
    _S.NEW: frozenset({_S.WAITING, _S.EXPECTED, _S.FINISHED}),
    _S.WAITING: frozenset({_S.RUNNING, _S.FINISHED}),
    _S.RUNNING: frozenset({_S.WAITING, _S.SENDING, _S.FINISHED}),
    _S.SENDING: frozenset({_S.FINISHED}),
    _S.EXPECTED: frozenset({_S.INCOMING, _S.FINISHED}),
    _S.INCOMING: frozenset({_S.RUNNING, _S.RELEASING, _S.FINISHED}),
    _S.RELEASING: frozenset({_S.FINISHED}),
    _S.FINISHED: frozenset(),
}


class InvalidTransition(AssertionError):
    """A state machine was moved to a status its current one does not lead to (a bookkeeping
    bug: an assertion, never an operator's error)."""


S = TypeVar("S", bound=enum.Enum)


def checked_move(what: str, current: S, new: S, allowed: Mapping[S, frozenset[S]]) -> S:
    """``new`` if ``allowed[current]`` lists it, else ``InvalidTransition`` naming both."""
    if new not in allowed[current]:
        raise InvalidTransition(f"{what}: {current.name} -> {new.name} is not allowed")
    return new


class NewOutputs(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobsMsg]  # one per token id when the request asked for logprobs


@dataclass(eq=False)
class Req:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    namespace: str = ""
    output_ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # KV slots of the tokens computed so far
    num_cached_tokens: int = 0  # leading prompt tokens served from a prefix cache
    cache_node: Any = None  # the prefix-cache node this request holds a lock on
    finish_reason: str | None = None
    error: str | None = None  # why the request failed here (finish_reason is then "abort")
    is_refused: bool = False  # ``error`` is the request's own fault (a 400 at the server)
    generator: Any = None  # torch.Generator for sampled requests; opaque to schedulers
    num_new_outputs: int = 0  # outputs not yet reported to the caller
    fill_len: int = 0  # tokens to compute before sampling: the prompt, or all ids on a resume
    num_admissions: int = 0  # > 1: the request was retracted and resumed
    num_draft: int = -1  # speculative tokens it may draft now (-1: the scheduler's maximum)
    status: ReqStatus = ReqStatus.NEW  # changed only by set_status
    # with ``params.logprobs`` set: one per output id, in step (else empty)
    output_logprobs: list[TokenLogprobsMsg] = field(default_factory=list)
    token_counts: Any = None  # what its penalties count (pd.executor.penalties); opaque here
    num_overtaken: int = 0  # later arrivals admitted ahead of it (pd.core.priority)
    guide: Any = None  # its grammar's matcher (pd.executor.grammar); opaque here
    is_paused: bool = False  # its client fell behind: left out of steps (Scheduler.set_paused)
    # on a decode node: the prefill node's cache hit, what its first token message said (-1:
    # none; a message sent again from offset 0 says it too)
    num_reported_cached_tokens: int = -1
    # outputs it had when this engine took it over from a dead node (a failover: they are
    # prefilled after the prompt); ``output_logprobs`` starts after them
    num_resumed: int = 0

    def __post_init__(self) -> None:
        self.fill_len = self.fill_len or len(self.prompt_ids)

    def set_status(self, status: ReqStatus) -> None:
        self.status = checked_move(
            f"request {self.request_id!r}", self.status, status, ALLOWED_TRANSITIONS
        )

    def finish(self, reason: str) -> None:
        """Done here, for ``reason`` ("stop", "length", "abort")."""
        self.finish_reason = reason
        self.set_status(ReqStatus.FINISHED)

    def fail(self, error: str, is_refused: bool = False) -> None:
        """Failed here (finish_reason "abort", ``error`` says why; ``is_refused``: the request's
        own fault, e.g. its grammar, answered with a 400)."""
        self.error = error
        self.is_refused = is_refused
        if self.status is not ReqStatus.FINISHED:
            self.finish("abort")
        else:
            self.finish_reason = "abort"

    def take_new_outputs(self) -> NewOutputs:
        """The outputs not yet reported to the caller (several after a speculative step whose
        draft was accepted) and their logprobs, now counted as reported."""
        n = self.num_new_outputs
        new = self.output_ids[len(self.output_ids) - n :]
        logprobs = self.output_logprobs[len(self.output_logprobs) - n :] if n else []
        assert not logprobs or len(logprobs) == n, (len(logprobs), n)
        self.num_new_outputs = 0
        return NewOutputs(new, logprobs)

    @property
    def priority(self) -> int:
        return self.params.priority

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_computed(self) -> int:
        return len(self.slots)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.fill_len

    @property
    def max_len(self) -> int:
        """Tokens this request may ever hold KV for (the last sampled token needs none)."""
        return len(self.prompt_ids) + self.params.max_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is ReqStatus.FINISHED
