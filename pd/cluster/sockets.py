"""``NodeSockets``: the server's end of the zmq links to the nodes.

One PULL socket receives what every node pushes (tokens, cache events, stats, pull reports); one
PUSH socket per node, made at its first message, carries requests, aborts and news of its peers
to it. Every frame either way is sealed under the cluster secret (``transfer.auth``).

The PULL socket takes at most ``max_conns`` connections at once (``transfer.conn_cap``: what
strangers can make it hold is bounded whatever they open). Its reader drops and counts what fails the seal (also by sending address),
decodes each authentic frame and hands the message to ``on_msg``; a message that does not
decode, or whose handling raises, is counted (``num_bad_msgs``) and dropped, and reading goes on.
A reader that dies is restarted (``num_reader_restarts``), and ``is_reading`` is false until it
reads an authentic frame again. The socket refuses frames over its size limit unread, and the
reader reads in bounded batches (``transfer.inbound``), yielding to the event loop between them
and pausing after a batch of nothing but refused frames: a flood of frames cannot keep HTTP,
``/health`` or the liveness watchdog from running.

A message for a node is refused here (``ValueError``, with the numbers) when its frame is over
what that node's inbox takes, instead of being dropped there unread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pd.core.messages import NodeInfo, ServerMsg
from transfer import inbound
from transfer.auth import Opener, Sealer
from transfer.conn_cap import MAX_CONNS, ConnectionCap

logger = logging.getLogger(__name__)
# What the reader handles between two turns of the event loop.
READ_BUDGET = inbound.ReadBudget(max_frames=256, max_bytes=16 << 20)
# After a batch of nothing but refused frames (a flood), the reader waits this long before the
# next: junk then costs at most ~25,000 frames/s of this process's CPU, and a node's frame
# waits at most this long behind it.
FLOOD_PAUSE_S = 0.01


@dataclass
class _Link:
    """A node's PUSH socket (made at its first message) and what its inbox takes."""

    addr: str
    max_model_len: int  # of its requests: what its inbox is sized for
    sock: zmq.asyncio.Socket | None = None
    sealer: Sealer | None = None


class NodeSockets:
    def __init__(
        self,
        max_msg_age_s: float,
        on_msg: Callable[[ServerMsg], None],
        max_conns: int = MAX_CONNS,
    ) -> None:
        """``on_msg`` handles each node message read, on the event loop; ``max_msg_age_s``: a
        frame stamped further from this clock is refused; ``max_conns``: connections the PULL
        socket takes at once (one per node)."""
        self._max_msg_age_s = max_msg_age_s
        self._max_conns = max_conns
        self._on_msg = on_msg
        self.rejects = inbound.RejectsByPeer("server")
        self.num_bad_msgs = 0  # node messages dropped: malformed, or their handling raised
        self.num_reader_restarts = 0
        self.is_reading = False  # the reader read an authentic frame since it (re)started
        self._secret = b""  # the cluster's, from ``bind``
        self._ctx: zmq.asyncio.Context | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._cap: ConnectionCap | None = None
        self._opener: Opener | None = None
        self._reader: inbound.SealedReader | None = None
        self._links: dict[str, _Link] = {}  # by node id
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ServerMsg)

    @property
    def num_rejected(self) -> int:
        """Frames that failed authentication."""
        return self._reader.num_rejected if self._reader is not None else 0

    @property
    def num_push_sockets(self) -> int:
        """PUSH sockets open (one per node sent anything since it registered)."""
        return sum(link.sock is not None for link in self._links.values())

    def add_node(self, info: NodeInfo) -> None:
        """Link ``info``'s node; one registered again at the same address keeps its socket."""
        link = self._links.get(info.node_id)
        if link is not None and link.addr == info.addr:
            link.max_model_len = info.max_model_len
            return
        self.remove_node(info.node_id)
        self._links[info.node_id] = _Link(info.addr, info.max_model_len)

    def remove_node(self, node_id: str) -> None:
        link = self._links.pop(node_id, None)
        if link is not None and link.sock is not None:
            link.sock.close(linger=0)

    def bind(self, pull_addr: str, addr: str, secret: bytes, max_model_len: int) -> None:
        """Bind the PULL socket at ``pull_addr``, where nodes push to ``addr`` with frames
        sealed under ``secret``, sized for requests of ``max_model_len`` tokens (at least
        ``inbound.DEFAULT_MAX_TOKENS``), and make its reader; ``read_forever`` reads it."""
        self._secret = secret
        self._opener = Opener(secret, addr, self._max_msg_age_s)
        self._ctx = zmq.asyncio.Context()
        # a message for a node that is gone must never hold up closing (nor a collected context)
        self._ctx.setsockopt(zmq.LINGER, 0)
        self._pull = self._ctx.socket(zmq.PULL)
        limit = inbound.max_frame_bytes(max(max_model_len, inbound.DEFAULT_MAX_TOKENS))
        inbound.limit_frame_size(self._pull, limit)
        self._cap = ConnectionCap(self._pull, self._max_conns, "server")
        self._pull.bind(pull_addr)
        self._cap.start(int(self._pull.last_endpoint.rsplit(b":", 1)[1]))
        # the reader reads through a plain (blocking-API) socket sharing the same libzmq one
        shadow = zmq.Socket.shadow(self._pull.underlying)
        self._reader = inbound.SealedReader(
            shadow, self._opener, self.rejects, READ_BUDGET, self._cap
        )

    async def read_forever(self) -> None:
        """Read node messages until cancelled, restarting the reader when it dies."""
        while True:
            try:
                await self._read_loop()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.is_reading = False  # /health says 503 until it reads again
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
                self.is_reading = True  # an authentic frame: junk alone does not count
                try:
                    self._on_msg(self._decoder.decode(got.payload))
                except Exception as e:  # malformed, or out of order: this message alone is lost
                    self.num_bad_msgs += 1
                    logger.warning("dropped a node message: %s: %s", type(e).__name__, e)
            # HTTP, /health and the watchdog run between batches
            await asyncio.sleep(FLOOD_PAUSE_S if self._reader.is_flooded else 0)

    def check_sendable(self, value: Any, what: str) -> None:
        """ValueError naming ``what`` when msgpack cannot carry ``value`` (nothing is sent)."""
        try:
            self._encoder.encode(value)
        except (OverflowError, TypeError, msgspec.EncodeError) as e:
            raise ValueError(f"{what} cannot be sent to the nodes: {e}") from e

    def send(self, node_id: str, msg: Any) -> None:
        """Seal ``msg`` and send it to the registered ``node_id`` without blocking; raises
        zmq.ZMQError when it cannot be queued, ValueError when it is over the node's limit."""
        link = self._links[node_id]
        if link.sock is None:
            assert self._ctx is not None, "bind() first"
            link.sock = self._ctx.socket(zmq.PUSH)
            link.sock.connect(link.addr)
            link.sealer = Sealer(self._secret, link.addr)
        assert link.sealer is not None
        frame = link.sealer.seal(self._encoder.encode(msg))
        limit = inbound.max_frame_bytes(link.max_model_len)  # what its inbox takes
        if len(frame) > limit:  # it would drop it unread: say so instead
            raise ValueError(f"a {len(frame)}-byte message is over {node_id}'s limit {limit}")
        link.sock.send(frame, flags=zmq.NOBLOCK)

    def tell(self, node_id: str, msg: Any) -> None:
        """``send``, for news a node may miss (an abort, a peer gone or up): nothing when the
        node is not registered (any more), before ``bind()`` (the nodes a cluster starts with
        register first; nothing is routed to them before), nor when it cannot be queued."""
        if node_id in self._links and self._ctx is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.send(node_id, msg)

    def close(self) -> None:
        for link in self._links.values():
            if link.sock is not None:
                link.sock.close(linger=0)
                link.sock = None
        if self._cap is not None:
            self._cap.close()
        if self._pull is not None:
            self._pull.close(linger=0)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # any socket left (none should be) is closed too
