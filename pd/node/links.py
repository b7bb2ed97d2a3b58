"""A node's sockets: the ``Inbox`` it binds (requests from the server, ``PrefilledMsg`` from
prefill nodes), the ``ServerLink`` it pushes tokens, cache events and stats on, and the
``PeerLinks`` to other nodes. Every frame is sealed under the cluster secret
(``transfer.auth``); what fails the seal is dropped and counted (also by sender), and so is what
does not decode. The inbox refuses frames over its size limit unread, takes at most
``max_conns`` connections at once (``transfer.conn_cap``) and hands the loop a bounded batch
per iteration (``transfer.inbound``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable
from typing import Any

import msgspec
import zmq

from pd.core.messages import NodeMsg, ResendMsg, ServerMsg, TokenLogprobsMsg, TokenMsg
from pd.core.request import Req
from pd.engine.scheduler import StepResult
from pd.node.replay import RecentOutputs, answer, split
from transfer.auth import AuthDrops, Opener, Sealer
from transfer.conn_cap import MAX_CONNS, ConnectionCap
from transfer.inbound import ReadBudget, RejectsByPeer, SealedReader, limit_frame_size

logger = logging.getLogger(__name__)

# Frames one loop iteration reads off the inbox, whatever they hold: the rest wait for the next
# iteration, so a flood cannot keep the node from stepping and beating.
INBOX_BUDGET = ReadBudget(max_frames=256, max_bytes=16 << 20)


class Inbox:
    """The node's PULL socket: decoded messages, or nothing for what fails the seal or decode."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        bind_host: str,
        host: str,
        secret: bytes,
        max_msg_age_s: float,
        node_id: str,
        max_frame_size: int,
        max_conns: int = MAX_CONNS,
    ) -> None:
        self._pull = ctx.socket(zmq.PULL)
        limit_frame_size(self._pull, max_frame_size)
        self._cap = ConnectionCap(self._pull, max_conns, f"{node_id} inbox")
        port = self._pull.bind_to_random_port(f"tcp://{bind_host}")
        self._cap.start(port)
        self.addr = f"tcp://{host}:{port}"
        self._opener = Opener(secret, self.addr, max_msg_age_s)
        self.rejects = RejectsByPeer(f"{node_id} inbox")
        self._reader = SealedReader(self._pull, self._opener, self.rejects, INBOX_BUDGET, self._cap)
        self._decoder = msgspec.msgpack.Decoder(NodeMsg)
        self._node_id = node_id
        self.num_bad_msgs = 0  # authentic frames that held no valid message

    @property
    def drops(self) -> AuthDrops:
        """Frames that failed authentication, by reason (forged, altered, replayed, stale)."""
        return self._opener.drops

    @property
    def num_rejected_msgs(self) -> int:
        """Frames that failed authentication, or were not even one frame."""
        return self._reader.num_rejected

    def recv_batch(self) -> list[NodeMsg]:
        """The valid messages among the next frames queued (at most ``INBOX_BUDGET``); none
        when nothing is queued. Frames that fail the seal or do not decode are counted and
        skipped."""
        out: list[NodeMsg] = []
        for got in self._reader.read():
            try:
                out.append(self._decoder.decode(got.payload))
            except (msgspec.ValidationError, msgspec.DecodeError) as e:
                self.num_bad_msgs += 1
                logger.warning("%s: dropped a malformed message: %s", self._node_id, e)
        return out

    def wait(self, timeout_ms: int) -> None:
        """Sleep until a frame comes or ``timeout_ms`` passes; under a flood of refused frames,
        ``timeout_ms`` (a frame always comes: an idle loop would spin on them, one each turn)."""
        if self._reader.is_flooded:
            time.sleep(timeout_ms / 1000)
        else:
            self._pull.poll(timeout_ms)

    def close(self) -> None:
        self._cap.close()
        self._pull.close(linger=0)


class ServerLink:
    """The PUSH socket to the server. While no server reads (it exited and a new one will
    attach), a message waits at most ``send_timeout_ms``, and later ones are dropped at once
    (``num_unsent_msgs``) until a send succeeds again. Every token message carries its offset
    in the request's output; the ends of finished requests are kept a while (``recent``), so
    the server can have a lost one sent again (``resend``: ``pd.node.replay``)."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        node_id: str,
        server_addr: str,
        secret: bytes,
        send_timeout_ms: int,
    ) -> None:
        self._ctx = ctx
        self._node_id = node_id
        self._secret = secret
        self._send_timeout_ms = send_timeout_ms
        self._encoder = msgspec.msgpack.Encoder()
        self._push, self._sealer = self._connect(server_addr)
        self._is_server_gone = False
        self.num_unsent_msgs = 0
        self.recent = RecentOutputs()

    def _connect(self, server_addr: str) -> tuple[zmq.Socket[Any], Sealer]:
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDTIMEO, self._send_timeout_ms)
        push.connect(server_addr)
        return push, Sealer(self._secret, server_addr)

    def repoint(self, server_addr: str) -> None:
        """Serve another server from now on; messages not sent to the old one are dropped."""
        self._push.close(linger=0)
        self._push, self._sealer = self._connect(server_addr)
        self._is_server_gone = False

    def send(self, msg: ServerMsg) -> None:
        frame = self._sealer.seal(self._encoder.encode(msg))
        try:  # once a send timed out, the server is gone: drop without waiting until one passes
            self._push.send(frame, zmq.NOBLOCK if self._is_server_gone else 0)
            self._is_server_gone = False
        except zmq.Again:
            self._is_server_gone = True
            self.num_unsent_msgs += 1

    def send_all(self, msgs: Iterable[ServerMsg]) -> None:
        for msg in msgs:
            self.send(msg)

    def report(
        self, req: Req, new_tokens: list[int], logprobs: list[TokenLogprobsMsg] | None = None
    ) -> None:
        """``req``'s new tokens (the last of its output), their logprobs if it asked for them
        (and its end, if it ended)."""
        if req.is_finished:
            self.recent.add_finished(req)
        self.send(
            TokenMsg(
                request_id=req.request_id,
                offset=len(req.output_ids) - len(new_tokens),
                token_ids=new_tokens,
                logprobs=logprobs or [],
                finished=req.is_finished,
                finish_reason=req.finish_reason,
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached_tokens,
                error=req.error,
                node_id=self._node_id,
            )
        )

    def report_error(
        self,
        request_id: str,
        error: str,
        can_retry: bool = False,
        is_refused: bool = False,
        offset: int = 0,
    ) -> None:
        """``can_retry``: the request itself is fine (its KV transfer or a peer failed);
        ``is_refused``: the request itself is at fault (its grammar), the server's 400;
        ``offset``: the tokens of it the server was sent (none before it streams)."""
        msg = TokenMsg(
            request_id=request_id,
            offset=offset,
            token_ids=[],
            finished=True,
            finish_reason="abort",
            num_prompt_tokens=0,
            num_cached_tokens=0,
            error=error,
            node_id=self._node_id,
            can_retry=can_retry,
            is_refused=is_refused,
        )
        self.recent.add_error(msg)
        self.send(msg)

    def resend(
        self, msg: ResendMsg, queued: Iterable[Req], held: Collection[str], streams: bool
    ) -> None:
        """Answer the server's ``ResendMsg`` (``pd.node.replay.answer`` says how): ``queued``,
        the requests the node's scheduler runs or queues; ``held``, the ids its role holds
        apart; ``streams``, whether this node streams tokens (a decode node)."""
        rid = msg.request_id
        live = next((r for r in queued if r.request_id == rid), None)
        is_held = live is None and rid in held
        self.send_all(split(answer(msg, live, is_held, streams, self.recent, self._node_id)))

    def report_step(self, result: StepResult) -> None:
        """The new tokens of the requests that produced any (a speculative step may produce
        several), errors of those that failed."""
        for req in result.failed:
            num_sent = len(req.output_ids) - req.num_new_outputs
            why = req.error or "failed"
            self.report_error(req.request_id, why, is_refused=req.is_refused, offset=num_sent)
        for req in result.produced:
            self.report(req, *req.take_new_outputs())

    def close(self) -> None:
        self._push.close(linger=0)


class PeerLinks:
    """PUSH sockets to other nodes' inboxes, opened on first use, closed when a peer goes."""

    def __init__(self, ctx: zmq.Context[Any], secret: bytes) -> None:
        self._ctx = ctx
        self._secret = secret
        self._encoder = msgspec.msgpack.Encoder()
        self._peers: dict[str, tuple[zmq.Socket[Any], Sealer]] = {}

    def __len__(self) -> int:
        return len(self._peers)

    def send(self, addr: str, msg: Any) -> None:
        peer = self._peers.get(addr)
        if peer is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.connect(addr)
            peer = self._peers[addr] = (sock, Sealer(self._secret, addr))
        peer[0].send(peer[1].seal(self._encoder.encode(msg)))

    def close_peer(self, addr: str) -> None:
        if (peer := self._peers.pop(addr, None)) is not None:
            peer[0].close(linger=0)

    def close(self) -> None:
        for sock, _ in self._peers.values():
            sock.close(linger=0)
        self._peers.clear()
