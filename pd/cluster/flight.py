"""``Flight``: one request as the cluster client sees it, with one status and one mailbox.

The status, and the only moves ``Flight`` allows (each checked where it is made):

1. ``NEW``: made by ``generate`` or ``warm``, nothing booked yet.
2. ``WAITING``: an attempt (its *wire id*: the request id, then ``id~1``, ...) waits in the
   queue for a node with room.
3. ``ROUTED``: the attempt's nodes have it (a prefill and a decode node, or the decode node
   alone); nothing has come back yet. -> ``STREAMING``, ``RETRY_PENDING``, ``REROUTING``, or
   ``FINISHED`` (a last message without tokens).
4. ``RETRY_PENDING``: its KV transfer failed; it moves to ``REROUTING`` after
   ``retry_delay_s``, or at once when a node death explains the failure.
5. ``STREAMING``: tokens came back (so maybe reached the caller): -> ``FINISHED``, or
   ``REROUTING`` when its decode node died (a *failover*, at most ``max_failovers`` times:
   ``can_fail_over``): its next attempt resumes from the output it has (``output_ids``).
6. ``REROUTING``: the attempt was given up and a ``REROUTE`` event waits in the mailbox; the
   next attempt goes back to ``WAITING``. An attempt after tokens came (a failover) goes to a
   decode node alone, with the prompt and ``output_ids``: it streams on from their offset.
7. Over: ``FINISHED`` (its last tokens came), ``FAILED`` (an error, its deadline) or
   ``ABORTED`` (``abort()``, or its caller stopped reading). Any status not over may fail or
   be aborted. The mailbox still holds the last event for the stream to read.

``WAITING``, ``ROUTED``, ``RETRY_PENDING`` and ``STREAMING`` hold an attempt (a wire id the
nodes and the coordinator know); leaving them gives it up (``end_attempt``).

The mailbox carries ``FlightEvent``s to the request's stream, in order: ``TOKENS`` (made from a
node's ``TokenMsg`` by ``Flights.on_tokens``), ``REROUTE``, ``ABORT`` (a last, empty output),
``ERROR``, ``STALLED`` (its client fell behind for too long: ``pd.core.backlog``) and
``DEADLINE`` (put by the flight's one deadline timer, armed at its stream's first wait); a
``TOKENS`` event's bytes count in its request's backlog until the stream reads it.
``Flights`` (``pd.cluster.flights``) makes every move of a flight but ``NEW``.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pd.cluster.room import RoomTicket
from pd.core.backlog import Backlog
from pd.core.messages import TokenLogprobsMsg
from pd.core.request import checked_move
from pd.core.sampling_params import SamplingParams


class FlightStatus(enum.Enum):
    NEW = enum.auto()
    WAITING = enum.auto()
    ROUTED = enum.auto()
    RETRY_PENDING = enum.auto()
    STREAMING = enum.auto()
    REROUTING = enum.auto()
    FINISHED = enum.auto()
    FAILED = enum.auto()
    ABORTED = enum.auto()


_S = FlightStatus
_END = frozenset({_S.FAILED, _S.ABORTED})  # where any status not over may go
ALLOWED: dict[FlightStatus, frozenset[FlightStatus]] = {
    _S.NEW: frozenset({_S.WAITING}) | _END,
    _S.WAITING: frozenset({_S.ROUTED}) | _END,
    _S.ROUTED: frozenset({_S.STREAMING, _S.RETRY_PENDING, _S.REROUTING, _S.FINISHED}) | _END,
    _S.RETRY_PENDING: frozenset({_S.STREAMING, _S.REROUTING, _S.FINISHED}) | _END,
    _S.STREAMING: frozenset({_S.FINISHED, _S.REROUTING}) | _END,
    _S.REROUTING: frozenset({_S.WAITING}) | _END,
    _S.FINISHED: frozenset(),
    _S.FAILED: frozenset(),
    _S.ABORTED: frozenset(),
}
_OVER = frozenset(s for s, after in ALLOWED.items() if not after)
_HOLDS_ATTEMPT = frozenset({_S.WAITING, _S.ROUTED, _S.RETRY_PENDING, _S.STREAMING})


class EventKind(enum.Enum):
    TOKENS = enum.auto()  # new tokens (maybe none); the last ones when ``finished``
    REROUTE = enum.auto()  # the attempt was given up: book the next (``why``)
    ABORT = enum.auto()  # abort() was called: a last output, empty, finish reason "abort"
    ERROR = enum.auto()  # it failed in the cluster (``why``): the stream raises
    STALLED = enum.auto()  # its client did not catch up (``why``): the stream raises
    DEADLINE = enum.auto()  # its deadline passed while its stream waited: the stream raises


class FlightEvent(NamedTuple):
    """What a flight's stream reads next. Make one with the class methods."""

    kind: EventKind
    token_ids: list[int]
    finished: bool  # the stream's last event (TOKENS that end it, ABORT, ERROR)
    finish_reason: str | None
    num_cached_tokens: int  # prompt tokens the prefill node had cached
    why: str  # a REROUTE's or an ERROR's reason
    logprobs: Sequence[TokenLogprobsMsg] = ()  # one per token id, when asked for
    num_bytes: int = 0  # what its token message counts in the request's backlog
    is_refused: bool = False  # an ERROR that is the request's own fault (its grammar)

    @classmethod
    def tokens(
        cls,
        token_ids: list[int],
        finished: bool,
        finish_reason: str | None,
        num_cached_tokens: int,
        logprobs: Sequence[TokenLogprobsMsg] = (),
        num_bytes: int = 0,
    ) -> FlightEvent:
        return cls(
            EventKind.TOKENS,
            token_ids,
            finished,
            finish_reason,
            num_cached_tokens,
            "",
            logprobs,
            num_bytes,
        )

    @classmethod
    def reroute(cls, why: str) -> FlightEvent:
        return cls(EventKind.REROUTE, [], False, None, 0, why)

    @classmethod
    def abort(cls) -> FlightEvent:
        return cls(EventKind.ABORT, [], True, "abort", 0, "")

    @classmethod
    def deadline(cls) -> FlightEvent:
        return cls(EventKind.DEADLINE, [], True, None, 0, "")

    @classmethod
    def error(
        cls, why: str, kind: EventKind = EventKind.ERROR, is_refused: bool = False
    ) -> FlightEvent:
        return cls(kind, [], True, None, 0, why, is_refused=is_refused)


class Attempt(NamedTuple):
    """An attempt that was given up: the id and the nodes to tell (``""``: none)."""

    wire_id: str
    prefill: str
    decode: str


@dataclass(eq=False)
class Flight:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    namespace: str
    is_warmup: bool = False  # warm a prefill node's cache: never prefilled on a decode node
    deadline: float = 0.0  # time.monotonic(), set when its stream starts
    mailbox: asyncio.Queue[FlightEvent] = field(default_factory=asyncio.Queue)
    ticket: RoomTicket = field(default_factory=RoomTicket)  # its place in the queue for room
    wire_id: str = ""  # the id the nodes know its latest attempt by
    prefill: str = ""  # the attempt's nodes; prefill is "" when the decode node prefills it
    decode: str = ""  # (both "" when it holds no routed attempt)
    last_prefill: str = ""  # the node that prefilled the latest attempt (kept after it ends)
    num_attempts: int = 0
    # tokens received (so maybe streamed to the caller): what a failover resumes from
    output_ids: list[int] = field(default_factory=list)
    num_failovers: int = 0  # attempts that resumed it after its decode node died
    # of the current attempt: its output's tokens received (the offset its next message
    # should have: ``pd.cluster.token_order``), when its nodes were last heard of (or it was
    # routed), when they were last asked to send its output again, and those that answered
    # they do not know it
    num_attempt_tokens: int = 0
    last_heard: float = 0.0
    asked_at: float = 0.0
    unknown_to: set[str] = field(default_factory=set)
    backlog: Backlog | None = None  # its request's queued token bytes (streams only)
    num_queued_bytes: int = 0  # of them, this flight's, in its mailbox
    paused_wire: str = ""  # the attempt its decode node was told to pause ("" none)
    deadline_timer: asyncio.TimerHandle | None = None  # puts DEADLINE in the mailbox
    _status: FlightStatus = field(default=FlightStatus.NEW, init=False)

    @property
    def status(self) -> FlightStatus:
        return self._status

    @property
    def num_received(self) -> int:
        return len(self.output_ids)

    @property
    def is_over(self) -> bool:
        return self._status in _OVER

    @property
    def holds_attempt(self) -> bool:
        """A wire id that nodes or the coordinator may know is live."""
        return self._status in _HOLDS_ATTEMPT

    def set_status(self, status: FlightStatus) -> None:
        """The one place a flight's status changes; a move ``ALLOWED`` does not list raises."""
        self._status = checked_move(f"flight {self.request_id}", self._status, status, ALLOWED)

    def can_reroute(self, max_reroutes: int) -> bool:
        """Nothing came back from the routed attempt, and attempts are left."""
        is_silent = self._status in (_S.ROUTED, _S.RETRY_PENDING)
        return is_silent and self.num_attempts <= max_reroutes

    def begin_attempt(self) -> str:
        """Wait for room under a new wire id (returned)."""
        self.set_status(_S.WAITING)
        n = self.num_attempts
        self.num_attempts += 1
        self.wire_id = self.request_id if n == 0 else f"{self.request_id}~{n}"
        self.num_attempt_tokens = len(self.output_ids)  # a failover's offsets go on from there
        self.unknown_to.clear()
        return self.wire_id

    def route(self, prefill: str | None, decode: str) -> None:
        """The attempt is booked on these nodes (``prefill`` None: the decode node prefills)."""
        self.set_status(_S.ROUTED)
        self.prefill, self.decode = prefill or "", decode
        self.last_heard, self.asked_at = time.monotonic(), 0.0
        self.last_prefill = self.prefill or decode

    def receive(self, token_ids: list[int]) -> None:
        """Tokens came back from the attempt's nodes (the next ones of its output)."""
        self.num_attempt_tokens += len(token_ids)
        self.output_ids += token_ids
        if token_ids and self._status is not _S.STREAMING:
            self.set_status(_S.STREAMING)

    def can_fail_over(self, max_failovers: int) -> bool:
        """Its decode node is gone, and it may go on on another: failovers are left, and so
        are tokens to generate. (One that streamed resumes from its output; one that did not,
        its re-routes spent, say after a transfer to a frozen node timed out, starts again.)"""
        left = len(self.output_ids) < self.params.max_tokens
        return self.holds_attempt and left and self.num_failovers < max_failovers

    def end_attempt(self, status: FlightStatus) -> Attempt | None:
        """Move to ``status`` (``REROUTING``, or over), giving up the attempt it holds: that
        attempt, or None when it held none."""
        held = self.holds_attempt
        attempt = Attempt(self.wire_id, self.prefill, self.decode)
        self.set_status(status)
        self.prefill = self.decode = ""
        return attempt if held else None

    def out_of_reroutes(self, error: str) -> str:
        """The error of a request that fails where it could have been re-routed (or failed
        over), saying why not when it was before (its attempts are spent)."""
        if self.num_failovers:
            error += f" (failed over {self.num_failovers} time(s) before: no more)"
        elif self.num_attempts > 1:
            error += f" (re-routed {self.num_attempts - 1} time(s) before: no more)"
        return error
