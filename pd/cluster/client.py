"""``ClusterClient``: the cluster behind the ``EngineClient`` interface, in the server process.

It is composed of parts, each in its own module: ``NodeSockets`` (``pd.cluster.sockets``: the
PULL socket every node pushes to, its sealed reader, a PUSH socket per node), ``Flights``
(``pd.cluster.flights``: the requests in flight and their attempts), ``Membership``
(``pd.cluster.membership``: which nodes are registered, their latest stats, which died, how
many start, and the watchdog, ``Liveness``), the ``Coordinator`` (which nodes, and what is
booked on them), ``MirrorSync`` (cache snapshots) and ``LoopHandoff``
(``pd.cluster.event_loop``). The client itself keeps the ``EngineClient`` surface: ``generate``, whose stream also samples each request's TTFT and TPOT
into ``ttft`` and ``tpot`` (the autoscaler's signals), ``abort``, ``is_ready``, ``stats``.

The life of a request (a *flight*, ``pd.cluster.flight``), by its status, and where each step
happens:

1. ``WAITING``: ``generate`` admits it (``Flights.admit``) and ``Flights.dispatch`` books a
   (prefill, decode) pair with the coordinator under the attempt's *wire id* (the request id,
   then ``id~1`` for a re-route), so messages of an attempt given up are recognised and
   dropped. When no node has room (or a pool is empty while its replacement starts; an empty
   prefill pool by choice only sends every request to a decode node alone), it waits in a FIFO
   queue, woken when a request finishes or a node joins, until its deadline
   (``request_timeout_s``).
2. ``ROUTED``: ``Flights.dispatch`` tells the decode node what to expect, the prefill node what
   to compute (or the decode node prefills it itself: conditional disaggregation), through
   ``NodeSockets``.
3. ``STREAMING``: tokens stream back from the decode node once the KV is there (a stream's
   request bounds what waits for its reader: ``pd.core.backlog``, ``Flights.on_flow``). ``NodeSockets``
   reads tokens, cache events fed to the coordinator, and stats (which are also the
   heartbeats), and hands each message to the client (``_on_node_msg``); ``Flights.on_tokens``
   turns each ``TokenMsg`` into a ``FlightEvent`` in the flight's mailbox, which its stream
   (``generate``) reads; by their offsets, repeated frames are dropped and lost ones asked for
   again (``pd.cluster.token_order``: also a request silent for ``token_probe_s``).
4. ``RETRY_PENDING``: its KV transfer failed before anything streamed; ``Flights`` re-routes it
   (5.) after ``retry_delay_s`` (a node death that caused the failure is usually found first:
   then it moves off that node at once).
5. ``REROUTING``: a node is dead when its Ray actor is gone or its heartbeat stops for
   ``heartbeat_timeout_s`` (``Liveness``, which calls ``Membership.fail_node``). The membership
   drops it (``Membership._drop``) and ``Flights.on_node_lost`` moves its requests: one that has streamed
   nothing is re-routed once, back to 1. (waiting for room or for a replacement node); one that
   streamed tokens from the dead decode node fails over (at most ``max_failovers`` times, then
   it fails): back to 1. too, resumed on a decode node alone from the tokens it streamed (its
   stream goes on with no token repeated or missing); one already decoding elsewhere is not
   touched. Every surviving node hears ``PeerGoneMsg`` and frees what it kept for the dead
   node; when a node registers, the others hear ``PeerUpMsg`` (its replacement may have been
   given the dead node's port, which they refuse for a while).
6. Over: ``FINISHED`` (its last tokens came), ``FAILED`` (an error, its deadline) or
   ``ABORTED`` (``abort``, or its caller stopped reading). Leaving an attempt (for 5., or over)
   releases its booking and wakes the next waiting request; unless it finished, its nodes are
   told to forget the attempt (``Flights._end_attempt``).

Membership calls (``client.membership.register_node``, ``fail_node``, ...) may come from any
thread: they run on the client's event loop, handed over explicitly when they come from
elsewhere (``LoopHandoff.call``).

A server that attaches to running nodes (its predecessor exited) registers them with
``membership.register_node(info, attached=True)``: it is not ready until each has sent its cache snapshot
(``MirrorSync``, which also repairs a mirror that lost events). ``warm`` prefills a prompt into
the cache of the prefill node it would be routed to, generating nothing beyond the first token.

Every frame either way is sealed under the cluster secret; ``is_ready`` is false while the
reader of node messages has not read an authentic frame since it (re)started (``NodeSockets``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import MappingProxyType
from typing import Any, NamedTuple

from pd.cluster.client_config import ROLES, ClientConfig
from pd.cluster.event_loop import LoopHandoff, TaskSet
from pd.cluster.flight import EventKind, Flight, FlightStatus
from pd.cluster.flights import ClusterError, Flights, RequestRefused
from pd.cluster.membership import Membership
from pd.cluster.mirror import MirrorSync
from pd.cluster.slo import LatencyWindow
from pd.cluster.sockets import NodeSockets
from pd.core.backlog import Backlog, ReaderStalled
from pd.core.messages import (
    CacheEventMsg,
    NodeInfo,
    NodeStatsMsg,
    PullDoneMsg,
    ServerMsg,
    TokenMsg,
)
from pd.core.outputs import ClusterStats, RequestOutput
from pd.core.sampling_params import SamplingParams
from pd.router.coordinator import Coordinator
from pd.router.pulls import PullLog
from pd.router.route_log import RouteRecord
from transfer.auth import DEFAULT_MAX_AGE_S
from transfer.conn_cap import MAX_CONNS
from transfer.endpoint import parse_endpoint

__all__ = ["ClusterClient", "WarmResult"]
logger = logging.getLogger(__name__)
# a warm-up ends at its first token, on the prefill node (nothing is sent to the decode node;
# on the decode node that prefills it when the prefill pool is empty)
_WARM_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


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
        max_conns: int = MAX_CONNS,
    ) -> None:
        """``resync(node_id)`` asks a node for its cache snapshot (``MirrorSync``);
        ``max_msg_age_s``: a frame stamped further from this clock is refused (the nodes');
        ``max_conns``: connections the PULL socket takes at once (``transfer.conn_cap``)."""
        self.coordinator = coordinator
        self.cfg = c = cfg or ClientConfig()
        self.pull_addr = pull_addr  # what the PULL socket binds
        self.addr = pull_addr  # what nodes push to (``listen_at``)
        self._secret = secret
        self._handoff = LoopHandoff()
        self._tasks = TaskSet()  # the reader, the watchdog, snapshot requests, retries
        self.sockets = NodeSockets(max_msg_age_s, self._on_node_msg, max_conns)
        nodes: dict[str, NodeInfo] = {}  # registered: ready or draining (the membership's)
        self.flights = Flights(coordinator, self.sockets, MappingProxyType(nodes), c, self._tasks)
        self.mirror = MirrorSync(coordinator, resync, c.watch_interval_s)
        self.membership = Membership(
            nodes, coordinator, self.sockets, self.flights, self.mirror, self._handoff, c, ping,
            on_node_failed,
        )  # fmt: skip
        # generate() to first token, less its waits for room (the autoscaler's prefill signal)
        self.ttft = LatencyWindow()
        self.tpot = LatencyWindow()  # per finished request: (last - first token) / (n - 1)

    # -- before start(), and what the parts show -------------------------------------------

    def listen_at(self, pull_addr: str, addr: str) -> None:
        """Bind the PULL socket at ``pull_addr`` (e.g. every interface) and tell nodes ``addr``
        (routable). Only before ``start()``."""
        assert self._handoff.loop is None, "the PULL socket is already bound"
        parse_endpoint(addr)
        self.pull_addr, self.addr = pull_addr, addr

    def use_secret(self, secret: bytes) -> None:
        """Seal and open frames under ``secret`` (that of running nodes this server attaches
        to). Only before ``start()``."""
        assert self._handoff.loop is None, "the PULL socket is already reading"
        self._secret = secret

    @property
    def pull_log(self) -> PullLog:
        """The coordinator's pull decisions and counts (to read)."""
        return self.coordinator.pulls

    def routes_of(self, request_id: str) -> list[RouteRecord]:
        """Where each attempt of ``request_id`` went, oldest first (``GET /admin/routes``)."""
        return self.coordinator.routes.of(request_id)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the client runs on (None before ``start()``)."""
        return self._handoff.loop

    @property
    def num_rejected_msgs(self) -> int:
        """Frames from nodes (or anyone else) that failed authentication."""
        return self.sockets.num_rejected

    # -- EngineClient -----------------------------------------------------------------------

    async def start(self) -> None:
        if self._handoff.loop is not None:
            return
        self._handoff.bind(asyncio.get_running_loop())
        # sized for the longest context of the nodes known now (they register before start)
        max_model_len = max((i.max_model_len for i in self.membership.nodes.values()), default=0)
        self.sockets.bind(self.pull_addr, self.addr, self._secret, max_model_len)
        self._tasks.spawn(self.sockets.read_forever())
        self._tasks.spawn(self.membership.liveness.run())
        self._tasks.spawn(self.mirror.run())
        self._tasks.spawn(self.flights.resends.run())

    def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        namespace: str = "",
        backlog: Backlog | None = None,
    ) -> AsyncIterator[RequestOutput]:
        flight = Flight(request_id, list(prompt_ids), params, namespace, backlog=backlog)
        return self._generate(flight)

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
        """The flight's stream (module docstring, steps 1-6), sampling its TTFT and TPOT."""
        await self.start()
        self.flights.admit(flight)  # before anything is booked: ValueError here alone
        arrival = time.monotonic()
        flight.deadline = arrival + self.cfg.request_timeout_s
        first_token = 0.0
        num_cached: int | None = None  # the prefill node's hit (the first output's)
        room_wait = 0.0  # in dispatch: waiting for a decode node with room (or a node at all)
        try:
            room_wait += await _timed(self.flights.dispatch(flight))
            while True:
                event = await self.flights.next_event(flight)
                if event.kind is EventKind.REROUTE:
                    logger.warning("re-routing %s: %s", flight.request_id, event.why)
                    room_wait += await _timed(self.flights.dispatch(flight))
                    continue
                if event.kind is EventKind.ERROR:  # its nodes were told to drop it
                    raise (RequestRefused if event.is_refused else ClusterError)(event.why)
                if event.kind is EventKind.STALLED:  # likewise
                    raise ReaderStalled(event.why)
                # TOKENS, or ABORT: a last output without tokens
                if num_cached is None:
                    num_cached = event.num_cached_tokens
                    first_token = time.monotonic()
                    self.ttft.add(first_token - arrival - room_wait, first_token)
                if event.finished and flight.num_received > 1:
                    now = time.monotonic()
                    self.tpot.add((now - first_token) / (flight.num_received - 1), now)
                yield RequestOutput(
                    flight.request_id,
                    event.token_ids,
                    event.finished,
                    event.finish_reason,
                    len(flight.prompt_ids),
                    num_cached,
                    logprobs=event.logprobs,
                )
                if event.finished:
                    return
        except (asyncio.CancelledError, GeneratorExit):  # its caller stopped reading
            self.flights.end(flight, FlightStatus.ABORTED)
            raise
        except BaseException:  # its deadline, or a node could not be reached
            self.flights.end(flight, FlightStatus.FAILED)
            raise
        finally:
            self.flights.leave(flight)

    async def abort(self, request_id: str) -> None:
        self.flights.abort(request_id)

    async def is_ready(self) -> bool:
        """The reader works (it has read since it last failed: nodes send stats a few times a
        second), and each pool needed has a node, or one starting (requests then wait for it)."""
        await self.start()
        m = self.membership
        ready = all(m.has_role(r) or m.num_starting(r) for r in _pools_needed(self.coordinator))
        return self.sockets.is_reading and ready and self.mirror.is_settled

    async def readiness(self) -> str | None:
        """Why a request could not be served now, or None (GET /ready answers 200 only then):
        unlike ``is_ready``, a node still starting does not count, so this is not None while a
        pool has no live, registered node (its last one died and its replacement starts)."""
        await self.start()
        if not self.sockets.is_reading:
            return "the server reads no node messages (its reader is starting or restarting)"
        for role in _pools_needed(self.coordinator):
            if not self.membership.has_role(role):
                starting = self.membership.num_starting(role)
                return f"no live {role} node" + (f" ({starting} starting)" if starting else "")
        if not self.mirror.is_settled:
            return "waiting for the cache snapshots of the nodes this server attached to"
        return None

    async def close(self) -> None:
        await self._tasks.cancel_all()
        self.sockets.close()

    def stats(self) -> ClusterStats:
        """What GET /metrics shows: every node's latest stats and the requests waiting."""
        pulls = self.coordinator.pulls
        return ClusterStats(
            list(self.membership.node_stats.values()),
            self.flights.num_waiting,
            num_rejected_msgs=self.num_rejected_msgs,
            rejected_by_peer=self.sockets.rejects.top(),
            num_dropped_msgs=self.sockets.num_bad_msgs,
            num_reader_restarts=self.sockets.num_reader_restarts,
            num_rerouted=self.flights.num_rerouted,
            num_failed_nodes=len(self.membership.dead_nodes),
            num_local_prefills=self.coordinator.num_local_routes,
            num_pulls_chosen=pulls.num_pulls,
            num_pulls_computed=pulls.num_computed,
            num_pull_fallbacks=pulls.num_fallbacks,
            num_stalled_streams=self.flights.num_stalled,
            num_queued_token_bytes=self.flights.num_queued_bytes,
            num_duplicate_token_msgs=self.flights.resends.num_duplicates,
            num_token_gaps=self.flights.resends.num_gaps,
            num_token_resends=self.flights.resends.num_asked,
            num_failovers=self.flights.num_failovers,
        )

    def _on_node_msg(self, msg: ServerMsg) -> None:
        """A message the reader read (a raise drops it, counted: ``NodeSockets``)."""
        if isinstance(msg, TokenMsg):
            self.flights.on_tokens(msg)
        elif msg.node_id not in self.membership.nodes:
            return  # a dead or removed node's late event or stats
        elif isinstance(msg, CacheEventMsg):
            self.coordinator.apply_event(msg)
            if msg.kind == "reset":
                self.mirror.on_reset(msg.node_id)
        elif isinstance(msg, NodeStatsMsg):
            self.membership.on_stats(msg)
        elif isinstance(msg, PullDoneMsg):
            self.coordinator.pulls.done(msg)


def _pools_needed(coordinator: Coordinator) -> tuple[str, ...]:
    """The pools a request needs a node of: the decode pool alone when the prefill pool is
    empty by choice (``Coordinator.decode_only``)."""
    return ("decode",) if coordinator.decode_only else ROLES


async def _timed(work: Awaitable[None]) -> float:
    """Seconds ``work`` took."""
    start = time.monotonic()
    await work
    return time.monotonic() - start
