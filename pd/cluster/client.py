"""``ClusterClient``: the cluster behind the ``EngineClient`` interface, in the server process.

The life of a request (a *flight*, ``pd.cluster.flight``), by its status:

1. ``WAITING``: ``generate`` books a (prefill, decode) pair with the coordinator under the
   attempt's *wire id* (the request id, then ``id~1`` for a re-route), so messages of an
   attempt given up are recognised and dropped. When no node has room (or a pool is empty while
   its replacement starts; an empty prefill pool by choice only sends every request to a decode
   node alone), it waits in a FIFO queue, woken when a request finishes or a node
   joins, until its deadline (``request_timeout_s``).
2. ``ROUTED``: the decode node is told what to expect, the prefill node what to compute (or
   the decode node prefills it itself: conditional disaggregation).
3. ``STREAMING``: tokens stream back from the decode node once the KV is there. One PULL
   socket receives tokens, cache events fed to the coordinator, and stats (which are also the
   heartbeats); the reader turns each ``TokenMsg`` into a ``FlightEvent`` in the flight's
   mailbox, which its stream reads.
4. ``RETRY_PENDING``: its KV transfer failed before anything streamed; it is re-routed (5.)
   after ``retry_delay_s`` (a node death that caused the failure is usually found first: then
   it moves off that node at once).
5. ``REROUTING``: a node is dead when its Ray actor is gone or its heartbeat stops for
   ``heartbeat_timeout_s``. A request it held that has streamed nothing is re-routed once,
   back to 1. (waiting for room or for a replacement node); one that streamed tokens from the
   dead decode node fails; one already decoding elsewhere is not touched. Every surviving node
   hears ``PeerGoneMsg`` and frees what it kept for the dead node.
6. Over: ``FINISHED`` (its last tokens came), ``FAILED`` (an error, its deadline) or
   ``ABORTED`` (``abort``, or its caller stopped reading). Leaving an attempt (for 5., or over)
   releases its booking and wakes the next waiting request; unless it finished, its nodes are
   told to forget the attempt.

Membership calls (``register_node``, ``fail_node``, ...) may come from any thread: they run on
the client's event loop, handed over explicitly when they come from elsewhere (``_on_loop``).

A server that attaches to running nodes (its predecessor exited) registers them with
``register_node(info, attached=True)``: it is not ready until each has sent its cache snapshot
(``MirrorSync``, which also repairs a mirror that lost events). ``warm`` prefills a prompt into
the cache of the prefill node it would be routed to, generating nothing beyond the first token.

Every frame either way is sealed under the cluster secret (``transfer.auth``). The reader of
node messages drops and counts what fails it (also by sending address), and survives any other
message (unknown, malformed, out of order: counted and dropped); it is restarted if it dies, and
``is_ready`` is false until it reads an authentic frame again. Its socket refuses frames over
its size limit unread, and it reads in bounded batches (``transfer.inbound``), yielding to the
event loop between them: a flood of frames cannot keep HTTP, ``/health`` or the liveness
watchdog from running.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import msgspec
import zmq
import zmq.asyncio

from pd.cluster.coordinator import Coordinator, Pull
from pd.cluster.flight import EventKind, Flight, FlightEvent, FlightStatus
from pd.cluster.liveness import Liveness
from pd.cluster.mirror import MirrorSync
from pd.cluster.room import RoomQueue
from pd.cluster.slo import LatencyWindow
from pd.core.messages import (
    AbortMsg,
    CacheEventMsg,
    DecodeReqMsg,
    LocalReqMsg,
    NodeInfo,
    NodeStatsMsg,
    PeerGoneMsg,
    PrefillReqMsg,
    PullDoneMsg,
    PullFrom,
    ServerMsg,
    TokenMsg,
)
from pd.core.options import option
from pd.core.outputs import ClusterStats, RequestOutput
from pd.core.sampling_params import SamplingParams
from transfer import inbound
from transfer.auth import DEFAULT_MAX_AGE_S, Opener, Sealer
from transfer.endpoint import parse_endpoint

logger = logging.getLogger(__name__)
T = TypeVar("T")
ROLES = ("prefill", "decode")
# Each pool's smallest size: the prefill pool may be empty (its decode nodes then prefill every
# prompt themselves: ``Coordinator.decode_only``), the decode pool may not.
MIN_POOL = {"prefill": 0, "decode": 1}
# a warm-up ends at its first token, on the prefill node (nothing is sent to the decode node;
# on the decode node that prefills it when the prefill pool is empty)
_WARM_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)
# What the reader handles between two turns of the event loop.
READ_BUDGET = inbound.ReadBudget(max_frames=256, max_bytes=16 << 20)
# After a batch of nothing but refused frames (a flood), the reader waits this long before the
# next: junk then costs at most ~25,000 frames/s of this process's CPU, and a node's frame
# waits at most this long behind it.
FLOOD_PAUSE_S = 0.01


class ClusterError(RuntimeError):
    """A request failed inside the cluster (a node rejected it or a transfer failed)."""


@dataclass(frozen=True)
class ClientConfig:
    """Deadlines and liveness of the cluster client."""

    request_timeout_s: float = option(600.0, "a request's deadline, waits for room included")
    heartbeat_timeout_s: float = option(
        10.0,
        "a node whose loop publishes nothing for this long is dead (its loop also beats between "
        "the layers of a forward pass)",
    )
    watch_interval_s: float = 0.25  # how often heartbeats are checked and actors pinged
    ping_timeout_s: float = 10.0  # an unanswered ping is left to the heartbeat to judge
    max_reroutes: int = 1  # times a request that streamed nothing moves off a dead node
    # a request that streamed nothing and whose KV transfer failed is re-routed after this
    # long, unless a node death explains the failure first (then at once, off that node)
    retry_delay_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("request_timeout_s", "heartbeat_timeout_s", "watch_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_reroutes < 0 or self.retry_delay_s < 0:
            raise ValueError(
                f"max_reroutes ({self.max_reroutes}) and retry_delay_s ({self.retry_delay_s}) "
                "must be >= 0"
            )


class WarmResult(NamedTuple):
    node_id: str  # the node whose cache holds the prompt now (a decode node: no prefill pool)
    num_tokens: int
    num_cached_tokens: int  # of them, held there already


class ClusterClient:
    def __init__(
        self,
        coordinator: Coordinator,
        pull_addr: str,
        cfg: ClientConfig | None = None,
        *,
        secret: bytes,
        ping: Callable[[str], Awaitable[Any]] | None = None,
        on_node_failed: Callable[[str], None] | None = None,
        resync: Callable[[str], Awaitable[int]] | None = None,
        max_msg_age_s: float = DEFAULT_MAX_AGE_S,
    ) -> None:
        """``resync(node_id)`` asks a node for its cache snapshot (``MirrorSync``);
        ``max_msg_age_s``: a frame stamped further from this clock is refused (the nodes')."""
        self.coordinator = coordinator
        self.pull_addr = pull_addr  # what the PULL socket binds
        self.addr = pull_addr  # what nodes push to (``listen_at``)
        self._secret = secret
        self._max_msg_age_s = max_msg_age_s
        self._opener = self._new_opener()
        self.rejects = inbound.RejectsByPeer("server")
        self._reader: inbound.SealedReader | None = None
        self.cfg = cfg or ClientConfig()
        self.nodes: dict[str, NodeInfo] = {}
        self.node_stats: dict[str, NodeStatsMsg] = {}
        self.dead_nodes: dict[str, str] = {}  # node_id -> why
        self.num_bad_msgs = 0  # node messages dropped: malformed, or a handler raised
        self.num_reader_restarts = 0
        self.num_rerouted = 0
        self._flights: dict[str, Flight] = {}  # by request id
        self._by_wire: dict[str, Flight] = {}  # by the wire id of its current attempt
        self._room = RoomQueue()
        self._num_starting = dict.fromkeys(ROLES, 0)  # nodes being started, per role
        c = self.cfg
        self.liveness = Liveness(
            c.heartbeat_timeout_s, c.watch_interval_s, c.ping_timeout_s, ping, self.fail_node
        )
        self._on_node_failed = on_node_failed  # e.g. the launcher starting a replacement
        self.mirror = MirrorSync(coordinator, resync, c.watch_interval_s)
        # generate() to first token, less its waits for room (the autoscaler's prefill signal)
        self.ttft = LatencyWindow()
        self.tpot = LatencyWindow()  # per finished request: (last - first token) / (n - 1)
        self._reader_ok = False
        self._ctx: zmq.asyncio.Context | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._push: dict[str, tuple[zmq.asyncio.Socket, Sealer]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ServerMsg)

    # -- membership: from any thread, and before start() (``_on_loop``) ---------------------

    def listen_at(self, pull_addr: str, addr: str) -> None:
        """Bind the PULL socket at ``pull_addr`` (e.g. every interface) and tell nodes ``addr``
        (routable). Only before ``start()``."""
        assert self._pull is None, "the PULL socket is already bound"
        parse_endpoint(addr)
        self.pull_addr, self.addr = pull_addr, addr
        self._opener = self._new_opener()

    def use_secret(self, secret: bytes) -> None:
        """Seal and open frames under ``secret`` (that of running nodes this server attaches
        to). Only before ``start()``."""
        assert self._pull is None, "the PULL socket is already reading"
        self._secret = secret
        self._opener = self._new_opener()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the client runs on (None before ``start()``)."""
        return self._loop

    @property
    def num_rejected_msgs(self) -> int:
        """Frames from nodes (or anyone else) that failed authentication."""
        reader = self._reader
        return reader.num_rejected if reader is not None else self._opener.drops.total

    def register_node(self, info: NodeInfo, attached: bool = False) -> None:
        """``attached``: the node ran before this server (its cache snapshot is awaited)."""
        self._on_loop(lambda: self._register_node(info, attached))

    def drain_node(self, node_id: str) -> None:
        self._on_loop(lambda: self.coordinator.drain(node_id))

    def unregister_node(self, node_id: str) -> None:
        """The node leaves (after draining): survivors close what they share with it."""
        self._on_loop(lambda: self._drop_node(node_id, "removed", is_dead=False))

    def fail_node(self, node_id: str, why: str) -> None:
        """The node died: re-route or fail its requests (module docstring, step 5)."""
        self._on_loop(lambda: self._drop_node(node_id, why, is_dead=True))

    def num_routed_to(self, node_id: str) -> int:
        """Requests in flight that this node serves (or is about to receive)."""
        flights = self._flights.values()
        return self._on_loop(lambda: sum(node_id in (f.prefill, f.decode) for f in flights))

    def begin_start(self, role: str) -> None:
        """A node of ``role`` is being started: requests may wait for it (``is_ready``)."""
        self._on_loop(lambda: self._count_starting(role, +1))

    def end_start(self, role: str) -> None:
        self._on_loop(lambda: self._count_starting(role, -1))

    # -- EngineClient -----------------------------------------------------------------------

    async def start(self) -> None:
        if self._pull is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.asyncio.Context()
        # a message for a node that is gone must never hold up closing (nor a collected context)
        self._ctx.setsockopt(zmq.LINGER, 0)
        self._pull = self._ctx.socket(zmq.PULL)
        # sized for the longest context of the nodes known now (they register before start)
        max_tokens = max((i.max_model_len for i in self.nodes.values()), default=0)
        limit = inbound.max_frame_bytes(max(max_tokens, inbound.DEFAULT_MAX_TOKENS))
        inbound.limit_frame_size(self._pull, limit)
        self._pull.bind(self.pull_addr)
        # the reader reads through a plain (blocking-API) socket sharing the same libzmq one
        shadow = zmq.Socket.shadow(self._pull.underlying)
        self._reader = inbound.SealedReader(shadow, self._opener, self.rejects, READ_BUDGET)
        self._run_task(self._read_forever())
        self._run_task(self.liveness.run())
        self._run_task(self.mirror.run())

    def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, namespace: str = ""
    ) -> AsyncIterator[RequestOutput]:
        return self._generate(Flight(request_id, list(prompt_ids), params, namespace))

    async def warm(self, request_id: str, prompt_ids: list[int], namespace: str = "") -> WarmResult:
        """Prefill ``prompt_ids`` into the cache of the prefill node the coordinator routes it
        to (as it would a request with this prompt; a decode node's when the prefill pool is
        empty), generating nothing."""
        flight = Flight(request_id, list(prompt_ids), _WARM_PARAMS, namespace, is_warmup=True)
        num_cached = 0
        async for out in self._generate(flight):
            num_cached = out.num_cached_tokens
        return WarmResult(flight.last_prefill, len(flight.prompt_ids), num_cached)

    async def _generate(self, flight: Flight) -> AsyncIterator[RequestOutput]:
        await self.start()
        request_id, prompt_ids = flight.request_id, flight.prompt_ids
        if request_id in self._flights:
            raise ValueError(f"request id {request_id!r} is already running")
        try:  # before anything is booked: a value msgpack cannot carry fails here alone
            self._encoder.encode(flight.params)
        except (OverflowError, TypeError, msgspec.EncodeError) as e:
            raise ValueError(f"sampling parameters cannot be sent to the nodes: {e}") from e
        arrival = time.monotonic()
        flight.deadline = arrival + self.cfg.request_timeout_s
        self._flights[request_id] = flight
        first_token = 0.0
        num_cached: int | None = None  # the prefill node's hit (the first output's)
        room_wait = 0.0  # in _dispatch: waiting for a decode node with room (or a node at all)
        try:
            room_wait += await self._timed(self._dispatch(flight))
            while True:
                event = await self._next(flight)
                if event.kind is EventKind.REROUTE:
                    logger.warning("re-routing %s: %s", request_id, event.why)
                    room_wait += await self._timed(self._dispatch(flight))
                    continue
                if event.kind is EventKind.ERROR:  # its nodes were told to drop it
                    raise ClusterError(event.why)
                # TOKENS, or ABORT: a last output without tokens
                if num_cached is None:
                    num_cached = event.num_cached_tokens
                    first_token = time.monotonic()
                    self.ttft.add(first_token - arrival - room_wait, first_token)
                if event.finished and flight.num_received > 1:
                    now = time.monotonic()
                    self.tpot.add((now - first_token) / (flight.num_received - 1), now)
                yield RequestOutput(
                    request_id,
                    event.token_ids,
                    event.finished,
                    event.finish_reason,
                    len(prompt_ids),
                    num_cached,
                )
                if event.finished:
                    return
        except (asyncio.CancelledError, GeneratorExit):  # its caller stopped reading
            self._end_flight(flight, FlightStatus.ABORTED)
            raise
        except BaseException:  # its deadline, or a node could not be reached
            self._end_flight(flight, FlightStatus.FAILED)
            raise
        finally:
            self._flights.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        flight = self._flights.get(request_id)
        if flight is None or flight.is_over:
            return
        self._end_attempt(flight, FlightStatus.ABORTED, abort_nodes=True)
        flight.mailbox.put_nowait(FlightEvent.abort())
        flight.ticket.cancel()  # stop waiting for room

    @property
    def pools_needed(self) -> tuple[str, ...]:
        """The pools a request needs a node of: the decode pool alone when the prefill pool is
        empty by choice (``Coordinator.decode_only``)."""
        return ("decode",) if self.coordinator.decode_only else ROLES

    async def is_ready(self) -> bool:
        """The reader works (it has read since it last failed: nodes send stats a few times a
        second), and each pool needed has a node, or one starting (requests then wait for it)."""
        await self.start()
        roles = {info.role for info in self.nodes.values()}
        roles |= {role for role, n in self._num_starting.items() if n}
        return self._reader_ok and roles >= set(self.pools_needed) and self.mirror.is_settled

    async def readiness(self) -> str | None:
        """Why a request could not be served now, or None (GET /ready answers 200 only then):
        unlike ``is_ready``, a node still starting does not count, so this is not None while a
        pool has no live, registered node (its last one died and its replacement starts)."""
        await self.start()
        if not self._reader_ok:
            return "the server reads no node messages (its reader is starting or restarting)"
        for role in self.pools_needed:
            if not any(info.role == role for info in self.nodes.values()):
                starting = self._num_starting[role]
                return f"no live {role} node" + (f" ({starting} starting)" if starting else "")
        if not self.mirror.is_settled:
            return "waiting for the cache snapshots of the nodes this server attached to"
        return None

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in [*(p[0] for p in self._push.values()), *([self._pull] if self._pull else [])]:
            sock.close(linger=0)
        self._push.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # any socket left (none should be) is closed too

    def stats(self) -> ClusterStats:
        """What GET /metrics shows: every node's latest stats and the requests waiting."""
        return ClusterStats(
            list(self.node_stats.values()),
            self._room.num_waiting,
            num_rejected_msgs=self.num_rejected_msgs,
            rejected_by_peer=self.rejects.top(),
            num_dropped_msgs=self.num_bad_msgs,
            num_reader_restarts=self.num_reader_restarts,
            num_rerouted=self.num_rerouted,
            num_failed_nodes=len(self.dead_nodes),
            num_local_prefills=self.coordinator.num_local_routes,
            num_pulls_chosen=self.coordinator.pulls.num_pulls,
            num_pulls_computed=self.coordinator.pulls.num_computed,
            num_pull_fallbacks=self.coordinator.pulls.num_fallbacks,
        )

    # -- a request's attempts ---------------------------------------------------------------

    async def _dispatch(self, flight: Flight) -> None:
        """Book nodes for the next attempt, waiting in FIFO order while none has room (until
        the deadline), and send the request to them."""
        if flight.status is FlightStatus.ABORTED:  # while re-routing: ABORT is next
            return
        wire = flight.begin_attempt()
        prompt, p, ns = flight.prompt_ids, flight.params, flight.namespace
        try:
            route = await self._room.wait(
                lambda: self.coordinator.route(
                    wire, prompt, p.max_tokens, ns, allow_local=not flight.is_warmup
                ),
                flight.deadline,
                flight.ticket,
                first=flight.num_attempts > 1,  # a re-routed request came before those waiting
            )
        except TimeoutError as e:
            limit = self.cfg.request_timeout_s
            raise TimeoutError(f"request {flight.request_id}: {e} ({limit} s)") from None
        if route is None:  # aborted while waiting: ABORT is in its mailbox
            return
        flight.route(route.prefill, route.decode)
        self._by_wire[wire] = flight
        d = self.nodes[route.decode]
        try:
            if route.prefill is None:
                self._send(
                    route.decode,
                    LocalReqMsg(request_id=wire, prompt_ids=prompt, sampling=p, namespace=ns),
                )
                return
            self._send(
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
                pull=self._pull_from(route.pull),
            )
            self._send(route.prefill, msg)
        except zmq.ZMQError as e:
            raise ClusterError(f"cannot reach {route.prefill} or {route.decode}: {e}") from e

    def _pull_from(self, pull: Pull | None) -> PullFrom | None:
        holder = None if pull is None else self.nodes.get(pull.holder)
        if pull is None or holder is None:
            return None
        return PullFrom(
            node_id=pull.holder,
            addr=holder.addr,
            transfer_addr=holder.transfer_addr,
            num_tokens=pull.num_tokens,
            timeout_s=pull.timeout_s,
        )

    @staticmethod
    async def _timed(work: Awaitable[None]) -> float:
        """Seconds ``work`` took."""
        start = time.monotonic()
        await work
        return time.monotonic() - start

    async def _next(self, flight: Flight) -> FlightEvent:
        if not flight.mailbox.empty():
            return flight.mailbox.get_nowait()
        left = flight.deadline - time.monotonic()
        try:
            return await asyncio.wait_for(flight.mailbox.get(), max(left, 0.0))
        except TimeoutError:
            raise TimeoutError(
                f"request {flight.request_id} passed its deadline ({self.cfg.request_timeout_s} s)"
            ) from None

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
                if node_id in self.nodes:
                    with contextlib.suppress(zmq.ZMQError):
                        self._send(node_id, AbortMsg(request_id=attempt.wire_id))
        self.coordinator.on_finished(attempt.wire_id)
        self._room.wake()

    def _end_flight(self, flight: Flight, status: FlightStatus) -> None:
        """Its stream ends before the flight is over (``status``: failed or aborted): its
        nodes drop the attempt."""
        if not flight.is_over:
            self._end_attempt(flight, status, abort_nodes=True)

    # -- membership, on the loop ------------------------------------------------------------

    def _register_node(self, info: NodeInfo, attached: bool) -> None:
        self.nodes[info.node_id] = info
        self.liveness.watch(info.node_id)
        if attached:
            self.mirror.expect_snapshot(info.node_id)
        if info.role == "prefill":
            self.coordinator.add_prefill(info.node_id)
        else:
            self.coordinator.add_decode(info.node_id, info.num_slots)
        self._room.wake()

    def _drop_node(self, node_id: str, why: str, is_dead: bool) -> None:
        info = self.nodes.pop(node_id, None)
        if info is None:  # dropped already
            return
        self.coordinator.remove(node_id)
        self.node_stats.pop(node_id, None)
        self.liveness.forget(node_id)
        self.mirror.forget(node_id)
        if (push := self._push.pop(node_id, None)) is not None:
            push[0].close(linger=0)
        if is_dead:
            logger.error("node %s is gone (%s)", node_id, why)
            self.dead_nodes[node_id] = why
        for flight in list(self._flights.values()):
            if node_id in (flight.prefill, flight.decode):
                self._on_node_lost(flight, node_id, why)
        gone = PeerGoneMsg(node_id=node_id, addr=info.addr, transfer_addr=info.transfer_addr)
        for other in list(self.nodes):
            with contextlib.suppress(zmq.ZMQError):
                self._send(other, gone)
        if is_dead and self._on_node_failed is not None:
            self._on_node_failed(node_id)

    def _count_starting(self, role: str, delta: int) -> None:
        self._num_starting[role] += delta

    def _reroute(self, flight: Flight, why: str) -> None:
        self._end_attempt(flight, FlightStatus.REROUTING, abort_nodes=True)  # the live ones
        self.num_rerouted += 1
        flight.mailbox.put_nowait(FlightEvent.reroute(why))

    def _fail(self, flight: Flight, error: str) -> None:
        """It failed in the cluster: its stream raises ``ClusterError(error)``, and its nodes
        (the partner may still hold it) drop the attempt."""
        flight.mailbox.put_nowait(FlightEvent.error(error))
        self._end_attempt(flight, FlightStatus.FAILED, abort_nodes=True)

    async def _retry_later(self, flight: Flight, wire_id: str, error: str) -> None:
        await asyncio.sleep(self.cfg.retry_delay_s)
        # no node death moved it meanwhile, and it is not over
        if flight.status is FlightStatus.RETRY_PENDING and flight.wire_id == wire_id:
            self._reroute(flight, error)

    def _on_node_lost(self, flight: Flight, node_id: str, why: str) -> None:
        if flight.can_reroute(self.cfg.max_reroutes):
            self._reroute(flight, f"node {node_id}: {why}")
        elif flight.status is not FlightStatus.STREAMING or node_id == flight.decode:
            self._fail(flight, flight.out_of_reroutes(f"node {node_id} failed: {why}"))
        # else it decodes on a live node that has its KV already: leave it be

    # -- the reader and the watchdog --------------------------------------------------------

    async def _read_forever(self) -> None:
        while True:
            try:
                await self._read_loop()
            except asyncio.CancelledError:
                raise
            except Exception:
                self._reader_ok = False  # /health says 503 until it reads again
                self.num_reader_restarts += 1
                logger.exception("the reader of node messages died; restarting it")
                await asyncio.sleep(0.05)

    async def _read_loop(self) -> None:
        assert self._pull is not None and self._reader is not None
        while True:
            await self._pull.poll(flags=zmq.POLLIN)
            # a bounded batch: what fails the seal is counted (by the opener, and by sender)
            batch = self._reader.read()
            for got in batch:
                self._reader_ok = True  # an authentic frame: junk alone does not count
                try:
                    self._on_node_msg(self._decoder.decode(got.payload))
                except Exception as e:  # malformed, or out of order: this message alone is lost
                    self.num_bad_msgs += 1
                    logger.warning("dropped a node message: %s: %s", type(e).__name__, e)
            # HTTP, /health and the watchdog run between batches
            await asyncio.sleep(FLOOD_PAUSE_S if self._reader.is_flooded else 0)

    def _on_node_msg(self, msg: ServerMsg) -> None:
        if isinstance(msg, TokenMsg):
            self._on_tokens(msg)
        elif msg.node_id not in self.nodes:
            return  # a dead or removed node's late event or stats
        elif isinstance(msg, CacheEventMsg):
            self.coordinator.apply_event(msg)
            if msg.kind == "reset":
                self.mirror.on_reset(msg.node_id)
        elif isinstance(msg, NodeStatsMsg):
            self.node_stats[msg.node_id] = msg
            self.liveness.heard(msg.node_id)
            per_token = max((n.kv_bytes_per_token for n in self.nodes.values()), default=0)
            self.coordinator.costs.update(self.node_stats.values(), per_token)
        elif isinstance(msg, PullDoneMsg):
            self.coordinator.pulls.done(msg)

    def _on_tokens(self, msg: TokenMsg) -> None:
        """Tokens, a finish or an error of an attempt, into its flight's mailbox."""
        wire = msg.request_id
        flight = self._by_wire.get(wire)
        if flight is None or msg.node_id not in (flight.prefill, flight.decode):
            return  # an attempt that was given up, or a node that was dropped
        if msg.can_retry and flight.can_reroute(self.cfg.max_reroutes):
            if flight.status is not FlightStatus.RETRY_PENDING:  # each side may report it
                flight.set_status(FlightStatus.RETRY_PENDING)
                self._run_task(self._retry_later(flight, wire, msg.error or ""))
            return
        flight.receive(len(msg.token_ids))
        if msg.error is not None:
            self.coordinator.on_prefilled(wire)
            retried = msg.can_retry  # retryable, but not again
            self._fail(flight, flight.out_of_reroutes(msg.error) if retried else msg.error)
            return
        event = FlightEvent.tokens(
            msg.token_ids, msg.finished, msg.finish_reason, msg.num_cached_tokens
        )
        flight.mailbox.put_nowait(event)  # first: the caller gets its tokens whatever follows
        self.coordinator.on_prefilled(wire)
        if msg.finished:
            self._end_attempt(flight, FlightStatus.FINISHED, abort_nodes=False)

    # -- helpers ----------------------------------------------------------------------------

    def _send(self, node_id: str, msg: Any) -> None:
        push = self._push.get(node_id)
        if push is None:
            assert self._ctx is not None
            addr = self.nodes[node_id].addr
            sock = self._ctx.socket(zmq.PUSH)
            sock.connect(addr)
            push = self._push[node_id] = (sock, Sealer(self._secret, addr))
        frame = push[1].seal(self._encoder.encode(msg))
        limit = inbound.max_frame_bytes(self.nodes[node_id].max_model_len)  # what its inbox takes
        if len(frame) > limit:  # it would drop it unread: say so instead
            raise ValueError(f"a {len(frame)}-byte message is over {node_id}'s limit {limit}")
        push[0].send(frame, flags=zmq.NOBLOCK)

    def _new_opener(self) -> Opener:
        return Opener(self._secret, self.addr, self._max_msg_age_s)

    def _run_task(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

    def _on_loop(self, fn: Callable[[], T]) -> T:
        """Run ``fn``, a membership change or read, where the client's state (these dicts, the
        coordinator, the zmq sockets) may be touched, and return its result. That state is
        the event loop's once ``start()`` ran, and a call comes
        - on that loop (the watchdog, the launcher's tasks): ``fn`` runs at once;
        - from another thread while the loop runs: ``fn`` is handed to the loop
          (``call_soon_threadsafe``) and this thread waits for its result;
        - before ``start()``: see ``_before_start``.
        After the loop stopped, nothing can run there: RuntimeError."""
        loop = self._loop
        if loop is None:
            return self._before_start(fn)
        if _running_loop() is loop:
            return fn()
        if not loop.is_running():
            raise RuntimeError("the cluster client's event loop has stopped")
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except BaseException as e:  # handed to the calling thread
                done.set_exception(e)

        loop.call_soon_threadsafe(run)
        return done.result(timeout=60)

    def _before_start(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the caller's thread, before ``start()`` (the launcher registers its
        first nodes so): no loop, reader or watchdog exists yet, so nothing else touches the
        state."""
        assert self._pull is None and not self._tasks, "started, but no loop is recorded"
        return fn()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # none on this thread
        return None
