"""The coordinator: books each request on the nodes ``RoutePolicy`` chooses, and keeps what is
booked until the request is prefilled and finished.

``route`` is two steps. First ``RoutePolicy.choose`` (``pd.router.policy``, whose docstring
gives the rules): the decode node, the prefill node or none (the decode node prefills the
request itself: conditional disaggregation), and a pull or not; it books nothing. Then
``_book``, the one place a route is booked: the decode node's KV slots for the prompt and the
answer's expected length (``expected_new_tokens``: at least 512 tokens, at most max_tokens), the
prompt's uncomputed tokens as load on the node that prefills it, the prompt as
pending there in the shared mirror (a follower routed before its cache events arrive finds it),
the pull decision in ``pulls`` (``PullLog``) and the route in ``routes`` (``RouteLog``, for
``GET /admin/routes``). ``on_prefilled`` (its first token came) releases the load and the
pending prompt; ``on_tokens`` grows the booking as the answer grows (to the tokens it has plus
as many again), so a request without max_tokens, which the server gives the rest of the
context, holds what it uses, not the context; ``on_finished`` releases the slots, grown or not.
A decode node's own admission expects no more than this (``SlotBudget.expected_len``), and
retracts a request when its pool runs out. Routing a request id that is still booked releases
that booking first.

What the policy chooses over: every node's cache, prefill and decode, replayed from its cache
events into one ``SharedPrefixIndex`` (``apply_event``), and ``nodes`` (``NodeTable``,
``pd.router.node_table``: the nodes, added, drained and removed there, and ``Members``, those
accepting requests). Pulls are weighed with ``costs`` (``PullCosts``), the rates in the nodes'
stats (``costs.update``); a node's report of a pull completes its decision (``pulls.done``). A node whose cache events were lost (a seq
gap) is listed in ``nodes_to_resync``, answered from its last consistent view, until its
``take_snapshot()`` arrives (``apply_snapshot``, or the reset event in its stream). All of this
is plain Python: the cluster client feeds it events, stats and request life-cycle calls.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pd.cache.holder_tree import TOKEN_BYTES, encode_tokens
from pd.cache.prefix_index import PrefixIndex, PrefixMatch, SharedPrefixIndex
from pd.core.messages import CacheEventMsg
from pd.engine.slots import expected_new_tokens
from pd.router.node_table import NodeTable
from pd.router.policy import (
    Choice,
    CoordinatorConfig,
    DecodeState,
    InFlight,
    PrefillState,
    RoutePolicy,
)
from pd.router.pulls import Pull, PullCosts, PullLog
from pd.router.route_log import RouteLog


class Route(NamedTuple):
    prefill: str | None  # None: the decode node prefills the request itself
    decode: str
    num_matched: int  # prompt tokens the node that prefills is expected to hold (pulls too)
    pull: Pull | None = None  # the prefill node first pulls this prefix


@dataclass(slots=True)
class _Booking:
    """What ``route`` booked for a request, grown by ``on_tokens``, released by
    ``on_prefilled``/``on_finished``. The nodes' states, not their ids: a node removed and
    registered again is a new state."""

    prefill: PrefillState | None  # None: prefilled on the decode node
    decode: DecodeState
    num_reserved_slots: int  # on the decode node; changed only by Coordinator._grow
    num_prompt_tokens: int
    max_tokens: int
    num_output_tokens: int = 0  # what its decode node has streamed so far


def _booked_len(page_size: int, num_prompt: int, max_tokens: int, num_output: int) -> int:
    """KV slots a request with ``num_output`` tokens generated is booked for: its prompt, its
    output and what it is expected to generate yet, in whole pages."""
    n = num_prompt + num_output + expected_new_tokens(max_tokens - num_output, num_output)
    return -(-n // page_size) * page_size


class Coordinator:
    def __init__(self, cfg: CoordinatorConfig) -> None:
        self.cfg = cfg
        self._mirror = SharedPrefixIndex(cfg.page_size)  # every node's cache, prefill and decode
        self.nodes = NodeTable(self._mirror)  # added, drained, removed there
        self._requests: dict[str, _Booking] = {}
        self.num_local_routes = 0  # requests sent to a decode node alone
        self._decode_only = False  # ``set_decode_only``
        self.costs = PullCosts()
        self.pulls = PullLog()
        self.routes = RouteLog()  # where each recent attempt went (GET /admin/routes)
        self.policy = RoutePolicy(cfg, self.costs)

    # -- the pools --------------------------------------------------------------------------

    def set_decode_only(self, on: bool) -> None:
        """``on`` while the prefill pool has no node and waits for no replacement (its target
        is 0, or its first node starts: the launcher says so, through the cluster client):
        with no prefill node accepting, every request is prefilled on its decode node. Off, a
        request waits (NoCapacityError) while the prefill pool has no node, e.g. for a
        replacement."""
        self._decode_only = on

    @property
    def decode_only(self) -> bool:
        return self._decode_only

    def index(self, node_id: str) -> PrefixIndex:
        """The mirror of a (prefill or decode) node's cache."""
        return self._mirror.index(node_id)

    # -- events, snapshots ------------------------------------------------------------------

    def apply_event(self, event: CacheEventMsg) -> None:
        self._mirror.apply(event)

    @property
    def nodes_to_resync(self) -> list[str]:
        """Nodes whose mirror missed cache events: ask each for ``take_snapshot()`` and hand it
        to ``apply_snapshot`` (or let its reset arrive in the event stream)."""
        return self._mirror.nodes_to_resync

    def apply_snapshot(self, node_id: str, events: Sequence[CacheEventMsg]) -> None:
        """Rebuild a node's mirror from its ``take_snapshot()``; a node gone since is ignored.
        Events the node published after the snapshot still apply after it, in seq order."""
        if node_id in self._mirror:
            self._mirror.index(node_id).apply_snapshot(events)

    # -- a request's life -------------------------------------------------------------------

    def route(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        max_tokens: int,
        namespace: str = "",
        *,
        allow_local: bool = True,
        local_only: bool = False,
    ) -> Route:
        """Choose both nodes (or the decode node alone: conditional disaggregation, unless not
        ``allow_local``; always with ``local_only``: a failover's resumed request, whose
        output its decode node prefills too), then book the request on them; raises
        NoCapacityError if no decode node has room now, ValueError if none ever could. Routing
        a request that is still booked releases its booking first."""
        if request_id in self._requests:
            self.on_finished(request_id)
        page = self.cfg.page_size
        most = -(-(len(prompt_ids) + max_tokens) // page) * page  # decode nodes take whole pages
        need = _booked_len(page, len(prompt_ids), max_tokens, 0)
        key = encode_tokens(prompt_ids)
        # The last prompt token is always computed (see BasePrefixCache.match_prompt).
        members = self.nodes.members()
        match = self._mirror.match(key[:-TOKEN_BYTES], namespace)
        choice = self.policy.choose(
            request_id,
            members,
            len(prompt_ids),
            need,
            most,
            match,
            allow_local=allow_local,
            decode_only=self._decode_only,
            local_only=local_only,
        )
        prompt = InFlight(key, namespace, len(prompt_ids) - choice.num_matched)
        booking = _Booking(choice.prefill, choice.decode, 0, len(prompt_ids), max_tokens)
        return self._book(request_id, choice, prompt, booking, need, match)

    def on_prefilled(self, request_id: str) -> None:
        """The request's first token came: its prefill load is gone, and its decode node is
        decoding it."""
        booking = self._requests.get(request_id)
        if booking is None:
            return
        booking.decode.started.add(request_id)
        node = booking.prefill
        if node is None:
            decode = booking.decode
            local = decode.local.pop(request_id, None)
            if local is not None:
                decode.local_load -= local.load
                if self.nodes.is_current(decode):
                    self._mirror.remove_pending(decode.node_id, local.key, local.namespace)
            return
        inflight = node.inflight.pop(request_id, None)
        if inflight is not None:
            self.nodes.add_load(node, -inflight.load)
            if self.nodes.is_current(node):  # a removed node took its prompts along
                self._mirror.remove_pending(node.node_id, inflight.key, inflight.namespace)

    def on_tokens(self, request_id: str, num_tokens: int) -> None:
        """Its decode node streamed ``num_tokens`` more: the booking grows to its prompt, its
        output and as many tokens again (``_booked_len``), never shrinks, never past
        max_tokens. It grows whether or not the node has room: the node retracts a request
        when its pool runs out, and new requests wait until bookings end."""
        booking = self._requests.get(request_id)
        if booking is None or num_tokens <= 0:
            return
        booking.num_output_tokens += num_tokens
        need = _booked_len(
            self.cfg.page_size,
            booking.num_prompt_tokens,
            booking.max_tokens,
            booking.num_output_tokens,
        )
        if need > booking.num_reserved_slots:
            self._grow(booking, need - booking.num_reserved_slots)

    def on_finished(self, request_id: str) -> None:
        self.on_prefilled(request_id)
        booking = self._requests.pop(request_id, None)
        if booking is not None:
            self._grow(booking, -booking.num_reserved_slots)
            booking.decode.started.discard(request_id)

    def check_integrity(self) -> None:
        """Loads and reservations are the sums of what is booked; the mirror's pending prompts
        are exactly the prompts in flight."""
        self.nodes.check_integrity()
        for node_id, node in self.nodes.prefill.items():
            assert node.load == sum(f.load for f in node.inflight.values()), (
                f"{node_id} load {node.load}, in flight {[f.load for f in node.inflight.values()]}"
            )
            assert all(self._requests[r].prefill is node for r in node.inflight)
        for node_id, decode in self.nodes.decode.items():
            booked = sum(
                b.num_reserved_slots for b in self._requests.values() if b.decode is decode
            )
            assert decode.reserved == booked, (
                f"{node_id} reserved {decode.reserved}, booked {booked}"
            )
            assert decode.local_load == sum(f.load for f in decode.local.values()), node_id
            assert all(self._requests[r].decode is decode for r in decode.local)
            assert all(self._requests[r].decode is decode for r in decode.started)
        for request_id, b in self._requests.items():  # grown to what its output says, no more
            expected = _booked_len(
                self.cfg.page_size, b.num_prompt_tokens, b.max_tokens, b.num_output_tokens
            )
            assert b.num_reserved_slots == expected, (request_id, b.num_reserved_slots, expected)
        self._mirror.check_integrity(
            (node_id, f.key, f.namespace)
            for node_id, flights in itertools.chain(
                ((n, p.inflight) for n, p in self.nodes.prefill.items()),
                ((n, d.local) for n, d in self.nodes.decode.items()),
            )
            for f in flights.values()
        )

    # -- bookkeeping ------------------------------------------------------------------------

    def _book(
        self,
        request_id: str,
        choice: Choice,
        prompt: InFlight,
        booking: _Booking,
        need: int,
        match: PrefixMatch,
    ) -> Route:
        """The one place a route is booked: ``need`` slots on the decode node, ``prompt`` in
        flight on the node that prefills it (its load there, and pending in the mirror), the
        pull decision and the route in their logs."""
        decode, prefill = choice.decode, choice.prefill
        self._grow(booking, need)
        if prefill is None:
            self.num_local_routes += 1
            decode.local[request_id] = prompt
            decode.local_load += prompt.load
        else:
            prefill.inflight[request_id] = prompt
            self.nodes.add_load(prefill, prompt.load)
        prefills = prefill or decode
        self._mirror.add_pending(prefills.node_id, prompt.key, prompt.namespace, after=match)
        self._requests[request_id] = booking
        if choice.decision is not None:  # weighed, whether or not a pull came of it
            self.pulls.add(choice.decision)
        route = Route(
            prefill.node_id if prefill is not None else None,
            decode.node_id,
            choice.num_matched,
            choice.pull,
        )
        self.routes.add(request_id, route)
        return route

    @staticmethod
    def _grow(booking: _Booking, delta: int) -> None:
        """The one place a booking's slots change, with its decode node's reservation."""
        booking.num_reserved_slots += delta
        booking.decode.reserved += delta
        assert booking.num_reserved_slots >= 0 and booking.decode.reserved >= 0, (
            booking.num_reserved_slots,
            booking.decode.reserved,
        )
