"""``ClusterClient``: the cluster behind the ``EngineClient`` interface, in the server process.

The life of a request (a *flight*) here:

1. ``generate`` books a (prefill, decode) pair with the coordinator. When no node has room (or a
   pool is empty while its replacement starts), the request waits in a FIFO queue, woken when
   a request finishes or a node joins, until its deadline (``request_timeout_s``).
2. The decode node is told what to expect, the prefill node what to compute, under the
   attempt's *wire id* (the request id, then ``id~1`` for a re-route), so messages of an
   abandoned attempt are recognised and dropped.
3. Tokens stream back from the decode node once the KV is there (one PULL socket receives
   tokens, cache events fed to the coordinator, and stats, which are also the heartbeats).
4. A node is dead when its Ray actor is gone or its heartbeat stops for ``heartbeat_timeout_s``.
   A request it held that has streamed nothing is re-routed once (2.), waiting for room or for
   a replacement node as in 1.; one that streamed tokens from the dead decode node ends with an
   error; one already decoding elsewhere is not touched. Every surviving node hears
   ``PeerGoneMsg`` and frees what it kept for the dead node. A request that streamed nothing
   and whose KV transfer failed is re-routed the same way, after ``retry_delay_s`` (a node
   death that caused the failure is usually found first: then it moves off that node at once).
5. Finish, error, abort or deadline: both nodes are told to forget the attempt, its booking
   is released, and the next waiting request is woken.

A server that attaches to running nodes (its predecessor exited) registers them with
``add_node(info, attached=True)``: it is not ready until each has sent its cache snapshot
(``MirrorSync``, which also repairs a mirror that lost events). ``warm`` prefills a prompt into
the cache of the prefill node it would be routed to, generating nothing beyond the first token.

Every frame either way is sealed under the cluster secret (``transfer.auth``). The reader of
node messages drops and counts what fails it, and survives any other message (unknown,
malformed, out of order: counted and dropped); it is restarted if it dies, and ``is_ready`` is
false until it reads again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import msgspec
import zmq
import zmq.asyncio

from pd.cluster.liveness import Liveness
from pd.cluster.mirror import MirrorSync
from pd.cluster.room import RoomQueue, Ticket
from pd.cluster.slo import LatencyWindow
from pd.config import _opt
from pd.coordinator import Coordinator
from pd.messages import (
    AbortMsg,
    CacheEventMsg,
    DecodeReqMsg,
    LocalReqMsg,
    NodeInfo,
    NodeStatsMsg,
    PeerGoneMsg,
    PrefillReqMsg,
    ServerMsg,
    TokenMsg,
)
from pd.outputs import ClusterStats, RequestOutput
from pd.sampling_params import SamplingParams
from transfer.auth import Opener, Sealer
from transfer.endpoint import parse_endpoint

logger = logging.getLogger(__name__)
T = TypeVar("T")
ROLES = ("prefill", "decode")
# a warm-up ends at its first token, on the prefill node (nothing is sent to the decode node)
_WARM_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


class ClusterError(RuntimeError):
    """A request failed inside the cluster (a node rejected it or a transfer failed)."""


@dataclass(frozen=True)
class ClientConfig:
    """Deadlines and liveness of the cluster client."""

    request_timeout_s: float = _opt(600.0, "a request's deadline, waits for room included")
    heartbeat_timeout_s: float = _opt(
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


class _Reroute(NamedTuple):
    why: str


class WarmResult(NamedTuple):
    node_id: str  # the prefill node whose cache holds the prompt now
    num_tokens: int
    num_cached_tokens: int  # of them, held there already


@dataclass(eq=False)
class _Flight:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    namespace: str
    deadline: float  # time.monotonic()
    queue: asyncio.Queue[TokenMsg | _Reroute] = field(default_factory=asyncio.Queue)
    wire_id: str = ""  # the id the nodes know the current attempt by ("" between attempts)
    prefill: str = ""  # "" also while the decode node prefills it (conditional disaggregation)
    decode: str = ""
    last_prefill: str = ""  # the prefill node of the latest attempt (kept after it ends)
    is_warmup: bool = False  # warm a prefill node's cache: never prefilled on a decode node
    num_attempts: int = 0
    num_received: int = 0  # tokens received (so maybe streamed to the caller)
    is_aborted: bool = False
    is_retry_pending: bool = False
    ticket: Ticket = field(default_factory=Ticket)  # its place in the queue for room


def _out_of_reroutes(flight: _Flight, error: str) -> str:
    """The error of a request that fails where it could have been re-routed, saying why not
    when it was re-routed before (its attempts are spent)."""
    if flight.num_attempts > 1:
        error += f" (re-routed {flight.num_attempts - 1} time(s) before: no more)"
    return error


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
    ) -> None:
        """``resync(node_id)`` asks a node for its cache snapshot (``MirrorSync``)."""
        self.coordinator = coordinator
        self.pull_addr = pull_addr  # what the PULL socket binds
        self.addr = pull_addr  # what nodes push to (``listen_at``)
        self._secret = secret
        self._opener = Opener(secret, pull_addr)
        self.cfg = cfg or ClientConfig()
        self.nodes: dict[str, NodeInfo] = {}
        self.node_stats: dict[str, NodeStatsMsg] = {}
        self.dead_nodes: dict[str, str] = {}  # node_id -> why
        self.num_bad_msgs = 0  # node messages dropped: malformed, or a handler raised
        self.num_reader_restarts = 0
        self.num_rerouted = 0
        self._flights: dict[str, _Flight] = {}  # by request id
        self._by_wire: dict[str, _Flight] = {}  # by the wire id of its current attempt
        self._room = RoomQueue()
        self._num_starting = dict.fromkeys(ROLES, 0)  # nodes being started, per role
        c = self.cfg
        self.liveness = Liveness(
            c.heartbeat_timeout_s, c.watch_interval_s, c.ping_timeout_s, ping, self.fail_node
        )
        self._on_node_failed = on_node_failed  # e.g. the launcher starting a replacement
        self.mirror = MirrorSync(coordinator, resync, c.watch_interval_s)
        self.ttft = LatencyWindow()  # generate() to first token, waits for room included
        self.tpot = LatencyWindow()  # per finished request: (last - first token) / (n - 1)
        self._reader_ok = False
        self._ctx: zmq.asyncio.Context | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._push: dict[str, tuple[zmq.asyncio.Socket, Sealer]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ServerMsg)

    # -- membership (the launcher calls these, from any thread) -----------------------------

    def listen_at(self, pull_addr: str, addr: str) -> None:
        """Bind the PULL socket at ``pull_addr`` (e.g. every interface) and tell nodes ``addr``
        (routable). Only before ``start()``."""
        assert self._pull is None, "the PULL socket is already bound"
        parse_endpoint(addr)
        self.pull_addr, self.addr = pull_addr, addr
        self._opener = Opener(self._secret, addr)

    def use_secret(self, secret: bytes) -> None:
        """Seal and open frames under ``secret`` (that of running nodes this server attaches
        to). Only before ``start()``."""
        assert self._pull is None, "the PULL socket is already reading"
        self._secret = secret
        self._opener = Opener(secret, self.addr)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the client runs on (None before ``start()``)."""
        return self._loop

    @property
    def num_rejected_msgs(self) -> int:
        """Frames from nodes (or anyone else) that failed authentication."""
        return self._opener.drops.total

    def add_node(self, info: NodeInfo, attached: bool = False) -> None:
        """``attached``: the node ran before this server (its cache snapshot is awaited)."""
        self._in_loop(lambda: self._add_node(info, attached))

    def drain_node(self, node_id: str) -> None:
        self._in_loop(lambda: self.coordinator.drain(node_id))

    def remove_node(self, node_id: str) -> None:
        """The node leaves (after draining): survivors close what they share with it."""
        self._in_loop(lambda: self._drop_node(node_id, "removed", is_dead=False))

    def fail_node(self, node_id: str, why: str) -> None:
        """The node died: re-route or fail its requests (module docstring, step 4)."""
        self._in_loop(lambda: self._drop_node(node_id, why, is_dead=True))

    def num_routed_to(self, node_id: str) -> int:
        """Requests in flight that this node serves (or is about to receive)."""
        flights = self._in_loop(lambda: list(self._flights.values()))
        return sum(node_id in (f.prefill, f.decode) for f in flights)

    def begin_start(self, role: str) -> None:
        """A node of ``role`` is being started: requests may wait for it (``is_ready``)."""
        self._in_loop(lambda: self._num_starting.__setitem__(role, self._num_starting[role] + 1))

    def end_start(self, role: str) -> None:
        self._in_loop(lambda: self._num_starting.__setitem__(role, self._num_starting[role] - 1))

    # -- EngineClient -----------------------------------------------------------------------

    async def start(self) -> None:
        if self._pull is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.asyncio.Context()
        # a message for a node that is gone must never hold up closing (nor a collected context)
        self._ctx.setsockopt(zmq.LINGER, 0)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self.pull_addr)
        self._spawn(self._read_forever())
        self._spawn(self.liveness.run())
        self._spawn(self.mirror.run())

    def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, namespace: str = ""
    ) -> AsyncIterator[RequestOutput]:
        return self._generate(_Flight(request_id, list(prompt_ids), params, namespace, 0.0))

    async def warm(self, request_id: str, prompt_ids: list[int], namespace: str = "") -> WarmResult:
        """Prefill ``prompt_ids`` into the cache of the prefill node the coordinator routes it
        to (as it would a request with this prompt), generating nothing."""
        flight = _Flight(request_id, list(prompt_ids), _WARM_PARAMS, namespace, 0.0)
        flight.is_warmup = True
        num_cached = 0
        async for out in self._generate(flight):
            num_cached = out.num_cached_tokens
        return WarmResult(flight.last_prefill, len(flight.prompt_ids), num_cached)

    async def _generate(self, flight: _Flight) -> AsyncIterator[RequestOutput]:
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
        finished = False
        first_token = 0.0
        try:
            await self._dispatch(flight)
            num_cached: int | None = None  # the prefill node's hit (the first message's)
            while not finished:
                msg = await self._next(flight)
                if isinstance(msg, _Reroute):
                    logger.warning("re-routing %s: %s", request_id, msg.why)
                    await self._dispatch(flight)
                    continue
                if msg.error is not None:  # the partner node may still hold it: abort below
                    raise ClusterError(msg.error)
                if num_cached is None:
                    num_cached = msg.num_cached_tokens
                    first_token = time.monotonic()
                    self.ttft.add(first_token - arrival, first_token)
                finished = msg.finished
                if finished and flight.num_received > 1:
                    now = time.monotonic()
                    self.tpot.add((now - first_token) / (flight.num_received - 1), now)
                yield RequestOutput(
                    request_id,
                    msg.token_ids,
                    finished,
                    msg.finish_reason,
                    len(prompt_ids),
                    num_cached,
                )
        finally:
            self._flights.pop(request_id, None)
            self._end_attempt(flight, abort=not finished)  # cancelled (client gone) or failed

    async def abort(self, request_id: str) -> None:
        flight = self._flights.get(request_id)
        if flight is None:
            return
        flight.is_aborted = True
        self._end_attempt(flight, abort=True)
        flight.queue.put_nowait(TokenMsg(request_id, [], True, "abort", 0, 0))
        flight.ticket.cancel()  # stop waiting for room

    async def is_ready(self) -> bool:
        """The reader works (it has read since it last failed: nodes send stats a few times a
        second), and each role has a node, or one starting (requests then wait for it)."""
        await self.start()
        roles = {info.role for info in self.nodes.values()}
        roles |= {role for role, n in self._num_starting.items() if n}
        return self._reader_ok and roles >= set(ROLES) and self.mirror.is_settled

    async def readiness(self) -> str | None:
        """Why a request could not be served now, or None (GET /ready answers 200 only then):
        unlike ``is_ready``, a node still starting does not count, so this is not None while a
        pool has no live, registered node (its last one died and its replacement starts)."""
        await self.start()
        if not self._reader_ok:
            return "the server reads no node messages (its reader is starting or restarting)"
        for role in ROLES:
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
            num_dropped_msgs=self.num_bad_msgs,
            num_reader_restarts=self.num_reader_restarts,
            num_rerouted=self.num_rerouted,
            num_failed_nodes=len(self.dead_nodes),
            num_local_prefills=self.coordinator.num_local_routes,
        )

    # -- a request's attempts ---------------------------------------------------------------

    async def _dispatch(self, flight: _Flight) -> None:
        """Book nodes for the next attempt, waiting in FIFO order while none has room (until
        the deadline), and send the request to them."""
        if flight.is_aborted:
            return
        flight.num_attempts += 1
        flight.is_retry_pending = False
        n = flight.num_attempts - 1
        wire = flight.wire_id = flight.request_id if n == 0 else f"{flight.request_id}~{n}"
        prompt, p, ns = flight.prompt_ids, flight.params, flight.namespace
        try:
            route = await self._room.wait(
                lambda: self.coordinator.route(
                    wire, prompt, p.max_tokens, ns, allow_local=not flight.is_warmup
                ),
                flight.deadline,
                flight.ticket,
                first=n > 0,  # a re-routed request came before those waiting
            )
        except TimeoutError as e:
            limit = self.cfg.request_timeout_s
            raise TimeoutError(f"request {flight.request_id}: {e} ({limit} s)") from None
        if route is None:  # aborted while waiting: the abort message is queued
            return
        flight.prefill, flight.decode = route.prefill or "", route.decode
        flight.last_prefill = flight.prefill
        self._by_wire[wire] = flight
        d = self.nodes[route.decode]
        try:
            if route.prefill is None:
                self._send(route.decode, LocalReqMsg(wire, prompt, p, ns))
                return
            self._send(route.decode, DecodeReqMsg(wire, prompt, p, ns, route.prefill))
            msg = PrefillReqMsg(wire, prompt, p, ns, route.decode, d.addr, d.transfer_addr)
            self._send(route.prefill, msg)
        except zmq.ZMQError as e:
            raise ClusterError(f"cannot reach {route.prefill} or {route.decode}: {e}") from e

    async def _next(self, flight: _Flight) -> TokenMsg | _Reroute:
        if not flight.queue.empty():
            return flight.queue.get_nowait()
        left = flight.deadline - time.monotonic()
        try:
            return await asyncio.wait_for(flight.queue.get(), max(left, 0.0))
        except TimeoutError:
            raise TimeoutError(
                f"request {flight.request_id} passed its deadline ({self.cfg.request_timeout_s} s)"
            ) from None

    def _end_attempt(self, flight: _Flight, abort: bool) -> None:
        """The current attempt is over: forget its wire id and its booking, and (``abort``)
        tell its nodes to drop it."""
        wire = flight.wire_id
        if not wire:
            return
        self._by_wire.pop(wire, None)
        if abort:
            for node_id in (flight.prefill, flight.decode):
                if node_id in self.nodes:
                    with contextlib.suppress(zmq.ZMQError):
                        self._send(node_id, AbortMsg(wire))
        self.coordinator.on_finished(wire)
        flight.wire_id, flight.prefill, flight.decode = "", "", ""
        self._room.wake()

    # -- membership, on the loop ------------------------------------------------------------

    def _add_node(self, info: NodeInfo, attached: bool) -> None:
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
        gone = PeerGoneMsg(node_id, info.addr, info.transfer_addr)
        for other in list(self.nodes):
            with contextlib.suppress(zmq.ZMQError):
                self._send(other, gone)
        if is_dead and self._on_node_failed is not None:
            self._on_node_failed(node_id)

    def _can_reroute(self, flight: _Flight) -> bool:
        return flight.num_received == 0 and flight.num_attempts <= self.cfg.max_reroutes

    def _reroute(self, flight: _Flight, why: str) -> None:
        self._end_attempt(flight, abort=True)  # its nodes (the live ones) forget it
        self.num_rerouted += 1
        flight.queue.put_nowait(_Reroute(why))

    async def _retry_later(self, flight: _Flight, wire_id: str, error: str) -> None:
        await asyncio.sleep(self.cfg.retry_delay_s)
        if flight.wire_id == wire_id:  # no node death moved it meanwhile, and it is not over
            self._reroute(flight, error)

    def _on_node_lost(self, flight: _Flight, node_id: str, why: str) -> None:
        if self._can_reroute(flight):
            self._reroute(flight, f"node {node_id}: {why}")
        elif flight.num_received == 0 or node_id == flight.decode:
            error = _out_of_reroutes(flight, f"node {node_id} failed: {why}")
            flight.queue.put_nowait(TokenMsg(flight.wire_id, [], True, "abort", 0, 0, error))
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
        assert self._pull is not None
        while True:
            frame = await self._pull.recv()
            self._reader_ok = True
            if (raw := self._opener.open(frame)) is None:
                continue  # failed authentication: counted by the opener
            try:
                self._on_node_msg(self._decoder.decode(raw))
            except Exception as e:  # malformed, or out of order: this message alone is lost
                self.num_bad_msgs += 1
                logger.warning("dropped a node message: %s: %s", type(e).__name__, e)

    def _on_node_msg(self, msg: ServerMsg) -> None:
        if isinstance(msg, TokenMsg):
            flight = self._by_wire.get(msg.request_id)
            if flight is None or msg.node_id not in (flight.prefill, flight.decode):
                return  # an attempt that was abandoned, or a node that was dropped
            if msg.can_retry and self._can_reroute(flight):
                if not flight.is_retry_pending:  # each side may report the same failure
                    flight.is_retry_pending = True
                    self._spawn(self._retry_later(flight, msg.request_id, msg.error or ""))
                return
            if msg.can_retry and msg.error is not None:  # retryable, but not again
                msg = msgspec.structs.replace(msg, error=_out_of_reroutes(flight, msg.error))
            flight.num_received += len(msg.token_ids)
            flight.queue.put_nowait(msg)  # first: the caller gets its tokens whatever follows
            self.coordinator.on_prefilled(msg.request_id)
        elif msg.node_id not in self.nodes:
            return  # a dead or removed node's late event or stats
        elif isinstance(msg, CacheEventMsg):
            self.coordinator.apply_event(msg)
            if msg.kind == "reset":
                self.mirror.on_reset(msg.node_id)
        elif isinstance(msg, NodeStatsMsg):
            self.node_stats[msg.node_id] = msg
            self.liveness.heard(msg.node_id)

    # -- helpers ----------------------------------------------------------------------------

    def _send(self, node_id: str, msg: Any) -> None:
        push = self._push.get(node_id)
        if push is None:
            assert self._ctx is not None
            addr = self.nodes[node_id].addr
            sock = self._ctx.socket(zmq.PUSH)
            sock.connect(addr)
            push = self._push[node_id] = (sock, Sealer(self._secret, addr))
        push[0].send(push[1].seal(self._encoder.encode(msg)), flags=zmq.NOBLOCK)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

    def _in_loop(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the client's event loop, from any thread (membership changes come
        from the launcher's threads; zmq sockets and these dicts are the loop's alone)."""
        loop = self._loop
        if loop is None or not loop.is_running():
            return fn()
        with contextlib.suppress(RuntimeError):
            if asyncio.get_running_loop() is loop:
                return fn()
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except BaseException as e:  # handed to the calling thread
                done.set_exception(e)

        loop.call_soon_threadsafe(run)
        return done.result(timeout=60)
