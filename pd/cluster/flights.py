"""``Flights``: the requests in flight in the cluster client, and each one's attempts.

The table of flights (``pd.cluster.flight``: one status and one mailbox per request), by
request id (``admit`` when its stream starts, ``leave`` when it ends) and by the wire id of each
one's current attempt. A request's attempts, in the order of the client's request life
(``pd.cluster.client``, steps 1-6):

- ``dispatch``: a new wire id; book the nodes with the coordinator, waiting in FIFO order for
  room (``RoomQueue``) until the deadline, then send the request to them (``NodeSockets``).
- ``on_tokens`` (the reader, for each ``TokenMsg``): tokens, a finish or an error into the
  flight's mailbox, the tokens into the attempt's booking (which grows with the answer); a
  duplicate is dropped, a gap asked for again (``pd.cluster.token_order``, which also probes
  silent requests: ``Resends.run``); a failed KV transfer of an attempt that streamed
  nothing is re-routed after ``retry_delay_s`` (``_retry_later``), unless a node death moves
  it first.
- ``on_node_lost`` (membership, for a dead or removed node): each flight on it is re-routed
  (a ``REROUTE`` event: the stream dispatches again), failed, or left decoding elsewhere. A
  started one on a dead decode node fails over (``Flight.can_fail_over``: at most
  ``max_failovers`` times, which also give one that streamed nothing more attempts once its
  re-routes are spent): re-routed too, its next attempt resumes on a decode node alone from
  the output the server has (the prompt and that output prefilled there, the same sampling
  parameters; its offsets, and so its stream, go on where they stopped).
- ``on_flow`` (its request's ``Backlog``, shared by its choices: ``pd.core.backlog``): its
  client fell behind, so its decode node is told to pause it (``PauseMsg``; a flight that has
  not streamed yet is told at its first tokens), or to resume it; a client that did not catch
  up in time ends it (``STALLED``, and its nodes drop it).
- ``abort``, ``end`` (the stream stopped early), or the last tokens: the attempt is over. Its
  booking is released, the next waiting request woken, and unless it finished its nodes are
  told to forget it (``_end_attempt``, the one place an attempt ends).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from functools import partial

import zmq

from pd.cluster.client_config import ClientConfig
from pd.cluster.event_loop import TaskSet
from pd.cluster.flight import EventKind, Flight, FlightEvent, FlightStatus
from pd.cluster.room import RoomQueue
from pd.cluster.sockets import NodeSockets
from pd.cluster.token_order import Order, Resends, take_new
from pd.core.backlog import Flow
from pd.core.messages import (
    AbortMsg,
    DecodeReqMsg,
    LocalReqMsg,
    NodeInfo,
    PauseMsg,
    PrefillReqMsg,
    PullFrom,
    TokenMsg,
)
from pd.router.coordinator import Coordinator, Route
from pd.router.pulls import Pull


class ClusterError(RuntimeError):
    """A request failed inside the cluster (a node rejected it or a transfer failed)."""


class RequestRefused(ValueError):
    """A node refused the request for its own fault (its grammar over the node's budget): the
    server answers it with a 400, as any ValueError of a request."""


class Flights:
    def __init__(
        self,
        coordinator: Coordinator,
        sockets: NodeSockets,
        nodes: Mapping[str, NodeInfo],
        cfg: ClientConfig,
        tasks: TaskSet,
    ) -> None:
        """``nodes``: the client's registered nodes (read here: their addresses); ``tasks``:
        where a retry waits."""
        self.coordinator = coordinator
        self.cfg = cfg
        self._sockets = sockets
        self._nodes = nodes
        self._tasks = tasks
        self._by_id: dict[str, Flight] = {}
        self._by_wire: dict[str, Flight] = {}  # by the wire id of its current attempt
        self._room = RoomQueue()
        # by request id: what watches its backlog (``on_flow`` of the flight)
        self._flow_watchers: dict[str, Callable[[Flow], None]] = {}
        self.num_rerouted = 0
        self.num_failovers = 0  # started requests resumed off a dead decode node
        self.num_stalled = 0  # requests ended because their client did not catch up
        self.resends = Resends(sockets, cfg, self._by_id)  # lost and duplicated token frames

    def __len__(self) -> int:
        """Requests in flight."""
        return len(self._by_id)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a node with room."""
        return self._room.num_waiting

    def wake(self) -> None:
        """Room may have appeared (a node joined): the first waiting request tries again."""
        self._room.wake()

    @property
    def num_queued_bytes(self) -> int:
        """Token bytes in the mailboxes of the streams (what their backlogs count)."""
        return sum(f.num_queued_bytes for f in self._by_id.values())

    def num_routed_to(self, node_id: str) -> int:
        """Requests in flight that this node serves (or is about to receive)."""
        return sum(node_id in (f.prefill, f.decode) for f in self._by_id.values())

    def admit(self, flight: Flight) -> None:
        """Into the table, before anything is booked; ValueError when its request id is
        running already, or when its sampling parameters cannot be sent (nothing is kept)."""
        if flight.request_id in self._by_id:
            raise ValueError(f"request id {flight.request_id!r} is already running")
        self._sockets.check_sendable(flight.params, "sampling parameters")
        self._by_id[flight.request_id] = flight
        if flight.backlog is not None:
            on_flow = self._flow_watchers[flight.request_id] = partial(self.on_flow, flight)
            flight.backlog.watch(on_flow)

    def leave(self, flight: Flight) -> None:
        """Out of the table: its stream has ended (what its mailbox holds leaves the
        backlog)."""
        self._by_id.pop(flight.request_id, None)
        if flight.deadline_timer is not None:
            flight.deadline_timer.cancel()
        on_flow = self._flow_watchers.pop(flight.request_id, None)
        if flight.backlog is not None and on_flow is not None:
            flight.backlog.unwatch(on_flow)
            flight.backlog.take(flight.num_queued_bytes)
            flight.num_queued_bytes = 0

    async def dispatch(self, flight: Flight) -> None:
        """Book nodes for the next attempt, waiting by priority then arrival while none has
        room (until the deadline), and send the request to them."""
        if flight.is_over:  # aborted or stalled while re-routing: its last event is next
            return
        wire = flight.begin_attempt()
        p, ns, resumed = flight.params, flight.namespace, flight.output_ids
        prompt, max_tokens = flight.prompt_ids + resumed, p.max_tokens - len(resumed)
        try:
            route = await self._room.wait(
                lambda: self.coordinator.route(
                    wire,
                    prompt,
                    max_tokens,
                    ns,
                    allow_local=not flight.is_warmup,
                    local_only=bool(resumed),  # a failover: its decode node prefills the output
                ),
                flight.deadline,
                flight.ticket,
                first=flight.num_attempts > 1,  # a re-routed request came before those waiting
                priority=p.priority,
            )
        except TimeoutError as e:
            limit = self.cfg.request_timeout_s
            raise TimeoutError(f"request {flight.request_id}: {e} ({limit} s)") from None
        if route is None:  # aborted while waiting: ABORT is in its mailbox
            return
        flight.route(route.prefill, route.decode)
        self._by_wire[wire] = flight
        try:
            send_attempt(self._sockets, self._nodes, flight, wire, route)
        except zmq.ZMQError as e:
            raise ClusterError(f"cannot reach {route.prefill} or {route.decode}: {e}") from e

    async def next_event(self, flight: Flight) -> FlightEvent:
        """The next event in its mailbox (its bytes leave the backlog); TimeoutError once its
        deadline passed with the mailbox empty. One timer per flight (armed here, at the first
        wait; ``leave`` cancels it) puts a ``DEADLINE`` event at the deadline, so a wait per
        token costs no timer and no task."""
        if flight.mailbox.empty():
            if flight.deadline_timer is None:
                left = max(flight.deadline - time.monotonic(), 0.0)
                put = partial(flight.mailbox.put_nowait, FlightEvent.deadline())
                flight.deadline_timer = asyncio.get_running_loop().call_later(left, put)
            event = await flight.mailbox.get()
        else:
            event = flight.mailbox.get_nowait()
        if event.kind is EventKind.DEADLINE:
            limit = self.cfg.request_timeout_s
            raise TimeoutError(f"request {flight.request_id} passed its deadline ({limit} s)")
        if event.num_bytes and flight.backlog is not None:
            flight.num_queued_bytes -= event.num_bytes
            flight.backlog.take(event.num_bytes)
        return event

    def abort(self, request_id: str) -> None:
        """Its stream ends with an empty last output (finish reason "abort")."""
        flight = self._by_id.get(request_id)
        if flight is None or flight.is_over:
            return
        self._end_attempt(flight, FlightStatus.ABORTED, abort_nodes=True)
        flight.mailbox.put_nowait(FlightEvent.abort())
        flight.ticket.cancel()  # stop waiting for room

    def end(self, flight: Flight, status: FlightStatus) -> None:
        """Its stream ends before the flight is over (``status``: failed or aborted): its
        nodes drop the attempt."""
        if not flight.is_over:
            self._end_attempt(flight, status, abort_nodes=True)

    def on_tokens(self, msg: TokenMsg) -> None:
        """Tokens, a finish or an error of an attempt, into its flight's mailbox."""
        wire = msg.request_id
        flight = self._by_wire.get(wire)
        if flight is None or msg.node_id not in (flight.prefill, flight.decode):
            return  # an attempt that was given up, or a node that was dropped
        if msg.can_retry and flight.can_reroute(self.cfg.max_reroutes):
            if flight.status is not FlightStatus.RETRY_PENDING:  # each side may report it
                flight.set_status(FlightStatus.RETRY_PENDING)
                self._tasks.spawn(self._retry_later(flight, wire, msg.error or ""))
            return
        flight.last_heard = time.monotonic()
        if msg.is_unknown and not self.resends.on_unknown(flight, msg):
            return  # the other node of the attempt may hold it
        flight.unknown_to.discard(msg.node_id)
        if msg.error is not None:
            self.coordinator.on_prefilled(wire)
            retried = msg.can_retry  # retryable, but not again
            why = flight.out_of_reroutes(msg.error) if retried else msg.error
            self._fail(flight, why, msg.is_refused)
            return
        taken = take_new(flight.num_attempt_tokens, msg)
        if taken.order is not Order.NEW:
            if taken.order is Order.GAP:
                self.resends.on_gap(flight, msg.node_id)
            else:
                self.resends.num_duplicates += 1
            return
        flight.receive(taken.token_ids)
        if not taken.token_ids and not msg.finished:
            return  # an answer to a probe: the node holds it, nothing new
        backlog = flight.backlog
        num_bytes = 0 if backlog is None else msg.num_bytes()
        event = FlightEvent.tokens(
            taken.token_ids,
            msg.finished,
            msg.finish_reason,
            msg.num_cached_tokens,
            taken.logprobs,
            num_bytes,
        )
        flight.mailbox.put_nowait(event)  # first: the caller gets its tokens whatever follows
        if backlog is not None:
            flight.num_queued_bytes += num_bytes
            backlog.add(num_bytes)  # past its high mark: every choice's node is told to pause
            if backlog.is_paused and flight.paused_wire != wire and not msg.finished:
                tell_paused(
                    self._sockets, flight, True
                )  # it streamed only now: it runs on its node
        self.coordinator.on_prefilled(wire)
        if msg.finished:
            self._end_attempt(flight, FlightStatus.FINISHED, abort_nodes=False)
        else:
            self.coordinator.on_tokens(wire, len(taken.token_ids))  # its booking grows with it

    def on_node_lost(self, node_id: str, why: str) -> None:
        """``node_id`` is gone (dead or removed): each flight it served moves off it."""
        for flight in list(self._by_id.values()):
            if node_id in (flight.prefill, flight.decode):
                self._lose(flight, node_id, why)

    def on_flow(self, flight: Flight, flow: Flow) -> None:
        """Its request's backlog passed its high mark (pause its decode node's steps for it),
        fell to its low mark (resume them), or stayed paused too long (end it)."""
        if flow is Flow.STALLED:
            if not flight.is_over:
                self.num_stalled += 1
                assert flight.backlog is not None
                why = (
                    f"request {flight.request_id}: its client did not catch up with its answer "
                    f"within {flight.backlog.max_pause_s:g} s (it was paused "
                    f"{flight.backlog.high_bytes} bytes of tokens ahead): ended"
                )
                flight.mailbox.put_nowait(FlightEvent.error(why, EventKind.STALLED))
                self._end_attempt(flight, FlightStatus.FAILED, abort_nodes=True)
                flight.ticket.cancel()  # stop waiting for room, if it waits
        elif flow is Flow.PAUSE:
            if flight.status is FlightStatus.STREAMING:  # else told at its first tokens
                tell_paused(self._sockets, flight, True)
        elif flight.paused_wire:
            tell_paused(self._sockets, flight, False)

    # -- an attempt -------------------------------------------------------------------------

    def _end_attempt(self, flight: Flight, status: FlightStatus, abort_nodes: bool) -> None:
        """Move the flight to ``status`` (re-routing, or over). The attempt it held (if any)
        is over: forget its wire id and its booking, and (``abort_nodes``) tell its nodes to
        drop it."""
        attempt = flight.end_attempt(status)
        if attempt is None:
            return
        self._by_wire.pop(attempt.wire_id, None)
        if abort_nodes:
            for node_id in (attempt.prefill, attempt.decode):
                self._sockets.tell(node_id, AbortMsg(request_id=attempt.wire_id))
        self.coordinator.on_finished(attempt.wire_id)
        self._room.wake()

    def _reroute(self, flight: Flight, why: str, is_failover: bool = False) -> None:
        self._end_attempt(flight, FlightStatus.REROUTING, abort_nodes=True)  # the live ones
        if is_failover:  # it started: it resumes from its output (``dispatch``)
            flight.num_failovers += 1
            self.num_failovers += 1
        else:
            self.num_rerouted += 1
        flight.mailbox.put_nowait(FlightEvent.reroute(why))

    def _fail(self, flight: Flight, error: str, is_refused: bool = False) -> None:
        """It failed in the cluster: its stream raises ``ClusterError(error)`` (or
        ``RequestRefused``: ``is_refused``), and its nodes (the partner may still hold it) drop
        the attempt."""
        flight.mailbox.put_nowait(FlightEvent.error(error, is_refused=is_refused))
        self._end_attempt(flight, FlightStatus.FAILED, abort_nodes=True)

    async def _retry_later(self, flight: Flight, wire_id: str, error: str) -> None:
        await asyncio.sleep(self.cfg.retry_delay_s)
        # no node death moved it meanwhile, and it is not over
        if flight.status is FlightStatus.RETRY_PENDING and flight.wire_id == wire_id:
            self._reroute(flight, error)

    def _lose(self, flight: Flight, node_id: str, why: str) -> None:
        is_decode = node_id == flight.decode
        if flight.can_reroute(self.cfg.max_reroutes):
            self._reroute(flight, f"node {node_id}: {why}")
        elif is_decode and flight.can_fail_over(self.cfg.max_failovers):
            self._reroute(flight, f"node {node_id}: {why}", is_failover=True)
        elif flight.status is not FlightStatus.STREAMING or is_decode:
            self._fail(flight, flight.out_of_reroutes(f"node {node_id} failed: {why}"))
        # else it decodes on a live node that has its KV already: leave it be


def send_attempt(
    sockets: NodeSockets, nodes: Mapping[str, NodeInfo], flight: Flight, wire: str, route: Route
) -> None:
    """Tell the decode node what to expect, the prefill node what to compute; or the
    decode node alone to prefill it."""
    prompt, p, ns = flight.prompt_ids, flight.params, flight.namespace
    d = nodes[route.decode]
    if route.prefill is None:  # with the output so far, when it resumes there (a failover)
        out = flight.output_ids
        msg = LocalReqMsg(
            request_id=wire, prompt_ids=prompt, sampling=p, namespace=ns, output_ids=out
        )
        sockets.send(route.decode, msg)
        return
    sockets.send(
        route.decode,
        DecodeReqMsg(
            request_id=wire,
            prompt_ids=prompt,
            sampling=p,
            namespace=ns,
            prefill_node=route.prefill,
        ),
    )
    msg = PrefillReqMsg(
        request_id=wire,
        prompt_ids=prompt,
        sampling=p,
        namespace=ns,
        decode_node=route.decode,
        decode_addr=d.addr,
        decode_transfer_addr=d.transfer_addr,
        pull=pull_from(nodes, route.pull),
    )
    sockets.send(route.prefill, msg)


def pull_from(nodes: Mapping[str, NodeInfo], pull: Pull | None) -> PullFrom | None:
    """Where the prefill node pulls ``pull``'s prefix from (None: no pull, or its holder is gone)."""
    holder = None if pull is None else nodes.get(pull.holder)
    if pull is None or holder is None:
        return None
    return PullFrom(
        node_id=pull.holder,
        addr=holder.addr,
        transfer_addr=holder.transfer_addr,
        num_tokens=pull.num_tokens,
        timeout_s=pull.timeout_s,
    )


def tell_paused(sockets: NodeSockets, flight: Flight, is_paused: bool) -> None:
    """Tell ``flight``'s decode node to leave its attempt out of its steps, or take it back."""
    wire = flight.wire_id if is_paused else flight.paused_wire
    sockets.tell(flight.decode, PauseMsg(request_id=wire, is_paused=is_paused))
    flight.paused_wire = wire if is_paused else ""
