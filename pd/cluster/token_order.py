"""The order of a request's token messages: duplicates dropped, gaps asked for again.

Every ``TokenMsg`` says where its tokens start in the request's output (``offset``). The
server keeps, per attempt, how many tokens it has (``Flight.num_attempt_tokens``), and
``take_new`` sorts each message against it:

- wholly before it: a ``DUPLICATE`` (a frame delivered twice), dropped and counted;
- overlapping it: only its new tail (tokens and logprobs) is taken (``NEW``);
- after it: a ``GAP``, tokens were lost on the way (a frame the node's socket dropped, or one a
  cut connection carried). The message is dropped and the node asked for the output from what
  the server has (``ResendMsg``); its answer overlaps, and fills the gap.

A request that streams, or waits for its first token, and has heard nothing from its nodes for
``ClientConfig.token_probe_s`` is asked the same (``Resends.probe``): a lost last frame is sent
again, a request still queued or paused there is answered without tokens (nothing is wrong),
and one its nodes no longer know ends at once with an error naming the tokens lost
(``TokenMsg.is_unknown``), never at its deadline. A flight is asked at most once per
``token_probe_s`` (a gap is asked at once, unless it was just asked). Errors are not sorted:
an attempt's error ends it wherever it falls.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from pd.cluster.client_config import ClientConfig
from pd.cluster.flight import Flight, FlightStatus
from pd.cluster.sockets import NodeSockets
from pd.core.messages import ResendMsg, TokenLogprobsMsg, TokenMsg


class Order(enum.Enum):
    NEW = enum.auto()  # tokens the server did not have (maybe none), or the end
    DUPLICATE = enum.auto()  # nothing new: drop it
    GAP = enum.auto()  # tokens before it were lost: ask for them


class Taken(NamedTuple):
    order: Order
    token_ids: list[int]  # the new ones
    logprobs: list[TokenLogprobsMsg]  # theirs, when the request asked for logprobs


def take_new(have: int, msg: TokenMsg) -> Taken:
    """Sort ``msg`` against the ``have`` tokens of its attempt the server has."""
    end = msg.offset + len(msg.token_ids)
    if msg.offset > have:
        return Taken(Order.GAP, [], [])
    if end < have or (end == have and msg.token_ids and not msg.finished):
        return Taken(Order.DUPLICATE, [], [])  # (a finished one that ends short is no end)
    skip = have - msg.offset
    logprobs = msg.logprobs[skip:] if msg.logprobs else []
    return Taken(Order.NEW, msg.token_ids[skip:], logprobs)


class Resends:
    """The server's side of lost and duplicated token frames: counts, and ``ResendMsg``s."""

    def __init__(
        self, sockets: NodeSockets, cfg: ClientConfig, flights: Mapping[str, Flight]
    ) -> None:
        """``flights``: the requests in flight (``Flights``'), read by ``run``."""
        self._sockets = sockets
        self._flights = flights
        self.probe_after_s = cfg.token_probe_s
        self.watch_interval_s = cfg.watch_interval_s
        self.num_duplicates = 0  # token messages dropped: the server had their tokens
        self.num_gaps = 0  # token messages that came after lost ones
        self.num_asked = 0  # ResendMsgs sent (after a gap, or to a silent request)

    async def run(self) -> None:
        """Every ``watch_interval_s``: ``probe`` the requests in flight."""
        while True:
            await asyncio.sleep(self.watch_interval_s)
            self.probe(self._flights.values())

    def on_gap(self, flight: Flight, node_id: str) -> None:
        """A message of ``node_id`` came after lost ones: ask it for what the server lacks,
        unless it was just asked (its answer may be on the way)."""
        self.num_gaps += 1
        if time.monotonic() - flight.asked_at > min(self.probe_after_s, 1.0):
            self._ask(flight, (node_id,))

    def probe(self, flights: Iterable[Flight]) -> None:
        """Ask the nodes of each flight silent for ``probe_after_s`` where it stands: its
        decode node once it streams, both its nodes before (the prefill node answers a request
        that ends at its first token)."""
        now = time.monotonic()
        for flight in flights:
            if flight.status not in (FlightStatus.ROUTED, FlightStatus.STREAMING):
                continue
            if now - max(flight.last_heard, flight.asked_at) < self.probe_after_s:
                continue
            if flight.status is FlightStatus.STREAMING or not flight.prefill:
                self._ask(flight, (flight.decode,))
            else:
                self._ask(flight, (flight.prefill, flight.decode))

    def on_unknown(self, flight: Flight, msg: TokenMsg) -> bool:
        """A node answered that it does not know the attempt: True when none of the nodes
        that could answer it does (the request's tokens are lost: it fails)."""
        flight.unknown_to.add(msg.node_id)
        if flight.status is FlightStatus.STREAMING:
            return msg.node_id == flight.decode
        return {flight.prefill, flight.decode} - {""} <= flight.unknown_to

    def _ask(self, flight: Flight, node_ids: tuple[str, ...]) -> None:
        flight.asked_at = time.monotonic()
        msg = ResendMsg(request_id=flight.wire_id, from_offset=flight.num_attempt_tokens)
        for node_id in node_ids:
            self.num_asked += 1
            self._sockets.tell(node_id, msg)
