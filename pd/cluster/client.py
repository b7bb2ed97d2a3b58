"""``ClusterClient``: the cluster behind the ``EngineClient`` interface, in the server process.

For each request it asks the coordinator for a (prefill, decode) pair, tells the decode node
what to expect and the prefill node what to compute, then streams the ``TokenMsg``s both send
back (the first token from the prefill node, the rest from the decode node). One PULL socket
receives everything the nodes send: tokens, cache events (fed to the coordinator) and stats.
Every frame either way is sealed under the cluster secret (``transfer.auth``); the reader drops
and counts what fails it, what does not decode and what fails to apply, and never stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pd.coordinator import Coordinator, NoCapacityError, Route
from pd.messages import (
    AbortMsg,
    CacheEventMsg,
    DecodeReqMsg,
    NodeInfo,
    NodeStatsMsg,
    PrefillReqMsg,
    ServerMsg,
    TokenMsg,
)
from pd.outputs import ClusterStats, RequestOutput
from pd.sampling_params import SamplingParams
from transfer.auth import Opener, Sealer
from transfer.endpoint import parse_endpoint

logger = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """A request failed inside the cluster (a node rejected it or a transfer failed)."""


class ClusterClient:
    def __init__(
        self,
        coordinator: Coordinator,
        pull_addr: str,
        *,
        secret: bytes,
        capacity_timeout_s: float = 300.0,
        ping: Callable[[str], Awaitable[Any]] | None = None,
        on_node_failed: Callable[[str], None] | None = None,
        ping_interval_s: float = 1.0,
        ping_timeout_s: float = 30.0,
    ) -> None:
        self.coordinator = coordinator
        self.pull_addr = pull_addr  # what the PULL socket binds
        self.addr = pull_addr  # what nodes push to (``listen_at``)
        self._secret = secret
        self._opener = Opener(secret, pull_addr)
        self.num_bad_msgs = 0  # authentic, but malformed or failed to apply
        self.capacity_timeout_s = capacity_timeout_s
        self.nodes: dict[str, NodeInfo] = {}
        self.node_stats: dict[str, NodeStatsMsg] = {}
        self._streams: dict[str, asyncio.Queue[TokenMsg]] = {}
        self._routes: dict[str, tuple[str, str]] = {}
        self._capacity = asyncio.Event()
        self._num_waiting = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._push: dict[str, tuple[zmq.asyncio.Socket, Sealer]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        # liveness comes from the lifecycle plane (a Ray actor call answers even while the
        # node's loop is busy in a long forward); a node that fails it is dropped
        self._ping = ping
        self._on_node_failed = on_node_failed  # e.g. the launcher starting a replacement
        self.ping_interval_s = ping_interval_s
        self.ping_timeout_s = ping_timeout_s
        self.dead_nodes: dict[str, str] = {}  # node_id -> why
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ServerMsg)

    # -- membership (the launcher calls these) ----------------------------------------------

    def listen_at(self, pull_addr: str, addr: str) -> None:
        """Bind the PULL socket at ``pull_addr`` (e.g. every interface) and tell nodes ``addr``
        (routable). Only before ``start()``."""
        assert self._pull is None, "the PULL socket is already bound"
        parse_endpoint(addr)
        self.pull_addr, self.addr = pull_addr, addr
        self._opener = Opener(self._secret, addr)

    @property
    def num_rejected_msgs(self) -> int:
        """Frames from nodes (or anyone else) that failed authentication."""
        return self._opener.drops.total

    def add_node(self, info: NodeInfo) -> None:
        self.nodes[info.node_id] = info
        if info.role == "prefill":
            self.coordinator.add_prefill(info.node_id)
        else:
            self.coordinator.add_decode(info.node_id, info.num_slots)

    def drain_node(self, node_id: str) -> None:
        self.coordinator.drain(node_id)

    def num_routed_to(self, node_id: str) -> int:
        """Requests in flight that this node serves (or is about to receive)."""
        return sum(node_id in route for route in list(self._routes.values()))

    def remove_node(self, node_id: str) -> None:
        self.coordinator.remove(node_id)
        self.nodes.pop(node_id, None)
        self.node_stats.pop(node_id, None)
        push = self._push.pop(node_id, None)
        if push is not None:
            push[0].close(linger=0)

    # -- EngineClient -----------------------------------------------------------------------

    async def start(self) -> None:
        if self._reader is not None:
            return
        self._ctx = zmq.asyncio.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self.pull_addr)
        self._reader = asyncio.create_task(self._read_loop())
        if self._ping is not None:
            self._watchdog = asyncio.create_task(self._watch_nodes())

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, namespace: str = ""
    ) -> AsyncIterator[RequestOutput]:
        await self.start()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        route = await self._route(request_id, prompt_ids, params, namespace)
        queue: asyncio.Queue[TokenMsg] = asyncio.Queue()
        self._streams[request_id] = queue
        self._routes[request_id] = (route.prefill, route.decode)
        d_info = self.nodes[route.decode]
        finished = False
        try:
            self._send(
                route.decode,
                DecodeReqMsg(request_id, prompt_ids, params, namespace, route.prefill),
            )
            self._send(
                route.prefill,
                PrefillReqMsg(
                    request_id,
                    prompt_ids,
                    params,
                    namespace,
                    route.decode,
                    d_info.addr,
                    d_info.transfer_addr,
                ),
            )
            num_cached: int | None = None  # the prefill node's hit (the first message's)
            while not finished:
                msg = await queue.get()
                if msg.error is not None:  # the partner node may still hold it: abort below
                    raise ClusterError(msg.error)
                if num_cached is None:
                    num_cached = msg.num_cached_tokens
                finished = msg.finished
                yield RequestOutput(
                    request_id,
                    msg.token_ids,
                    finished,
                    msg.finish_reason,
                    len(prompt_ids),
                    num_cached,
                )
        finally:
            if not finished:  # cancelled (client gone) or failed
                self._abort_on_nodes(request_id, route.prefill, route.decode)
            self._streams.pop(request_id, None)
            self._routes.pop(request_id, None)
            self.coordinator.on_finished(request_id)
            self._capacity.set()

    async def abort(self, request_id: str) -> None:
        route = self._routes.get(request_id)
        if route is not None:
            self._abort_on_nodes(request_id, *route)
            queue = self._streams.get(request_id)
            if queue is not None:
                queue.put_nowait(TokenMsg(request_id, [], True, "abort", 0, 0))

    async def is_ready(self) -> bool:
        """Every registered node has started its loop (sent stats). A node that dies is
        dropped by the watchdog, so readiness never waits on a long forward pass."""
        await self.start()
        roles = {info.role for info in self.nodes.values()}
        return roles == {"prefill", "decode"} and all(n in self.node_stats for n in self.nodes)

    async def close(self) -> None:
        for task in (self._reader, self._watchdog):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for sock in [*(p[0] for p in self._push.values()), *([self._pull] if self._pull else [])]:
            sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()

    # -- internals --------------------------------------------------------------------------

    async def _route(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, namespace: str
    ) -> Route:
        deadline = time.monotonic() + self.capacity_timeout_s
        self._num_waiting += 1
        try:
            while True:
                try:
                    return self.coordinator.route(
                        request_id, prompt_ids, params.max_tokens, namespace
                    )
                except NoCapacityError:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise
                    self._capacity.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._capacity.wait(), timeout=min(left, 1.0))
        finally:
            self._num_waiting -= 1

    def _send(self, node_id: str, msg: Any) -> None:
        push = self._push.get(node_id)
        if push is None:
            assert self._ctx is not None
            addr = self.nodes[node_id].addr
            sock = self._ctx.socket(zmq.PUSH)
            sock.connect(addr)
            push = self._push[node_id] = (sock, Sealer(self._secret, addr))
        push[0].send(push[1].seal(self._encoder.encode(msg)), flags=zmq.NOBLOCK)

    def _abort_on_nodes(self, request_id: str, prefill: str, decode: str) -> None:
        for node_id in (prefill, decode):
            if node_id in self.nodes:
                with contextlib.suppress(zmq.ZMQError):
                    self._send(node_id, AbortMsg(request_id))

    async def _read_loop(self) -> None:
        assert self._pull is not None
        while True:
            frame = await self._pull.recv()
            if (raw := self._opener.open(frame)) is None:
                continue
            try:
                self._on_msg(self._decoder.decode(raw))
            except Exception as e:  # one bad message must never stop the reader
                self.num_bad_msgs += 1
                logger.warning("dropped a node message (%d so far): %r", self.num_bad_msgs, e)

    def _on_msg(self, msg: ServerMsg) -> None:
        if isinstance(msg, TokenMsg):
            # the first token of a request comes from its prefill node (idempotent after)
            self.coordinator.on_prefilled(msg.request_id)
            queue = self._streams.get(msg.request_id)
            if queue is not None:
                queue.put_nowait(msg)
        elif isinstance(msg, CacheEventMsg):
            self.coordinator.apply_event(msg)
        elif isinstance(msg, NodeStatsMsg):
            self.node_stats[msg.node_id] = msg

    async def _watch_nodes(self) -> None:
        assert self._ping is not None
        while True:
            await asyncio.sleep(self.ping_interval_s)
            for node_id in list(self.nodes):
                try:
                    await asyncio.wait_for(self._ping(node_id), timeout=self.ping_timeout_s)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # any failure means the node is gone
                    self.fail_node(node_id, f"{type(e).__name__}: {e}")

    def fail_node(self, node_id: str, why: str) -> None:
        """A node died: stop routing to it and fail (not hang) every request it was serving."""
        if node_id not in self.nodes:  # removed on purpose meanwhile
            return
        logger.error("node %s is gone (%s); failing its requests", node_id, why)
        self.dead_nodes[node_id] = why
        for request_id, route in list(self._routes.items()):
            if node_id in route:
                queue = self._streams.get(request_id)
                if queue is not None:
                    queue.put_nowait(
                        TokenMsg(
                            request_id, [], True, "abort", 0, 0, f"node {node_id} failed: {why}"
                        )
                    )
        self.remove_node(node_id)
        if self._on_node_failed is not None:
            self._on_node_failed(node_id)

    def stats(self) -> ClusterStats:
        """What GET /metrics shows: every node's latest stats and the requests waiting."""
        return ClusterStats(
            list(self.node_stats.values()),
            self._num_waiting,
            num_rejected_msgs=self.num_rejected_msgs,
            num_dropped_msgs=self.num_bad_msgs,
        )
