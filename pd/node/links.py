"""A node's sockets: the ``Inbox`` it binds (requests from the server, ``PrefilledMsg`` from
prefill nodes), the ``ServerLink`` it pushes tokens, cache events and stats on, and the
``PeerLinks`` to other nodes. Every frame is sealed under the cluster secret
(``transfer.auth``); what fails the seal is dropped and counted, and so is what does not decode.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import msgspec
import zmq

from pd.core.messages import NodeMsg, ServerMsg, TokenMsg
from pd.core.request import Req
from pd.engine.scheduler import StepResult
from transfer.auth import AuthDrops, Opener, Sealer

logger = logging.getLogger(__name__)


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
    ) -> None:
        self._pull = ctx.socket(zmq.PULL)
        self.addr = f"tcp://{host}:{self._pull.bind_to_random_port(f'tcp://{bind_host}')}"
        self._opener = Opener(secret, self.addr, max_msg_age_s)
        self._decoder = msgspec.msgpack.Decoder(NodeMsg)
        self._node_id = node_id
        self.num_bad_msgs = 0  # authentic frames that held no valid message

    @property
    def drops(self) -> AuthDrops:
        """Frames that failed authentication, by reason (forged, altered, replayed, stale)."""
        return self._opener.drops

    @property
    def num_rejected_msgs(self) -> int:
        return self._opener.drops.total

    def recv(self) -> NodeMsg | None:
        """The next valid message, None when nothing is queued. Frames that fail the seal or do
        not decode are counted and skipped."""
        while True:
            try:
                frame = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return None
            if (raw := self._opener.open(frame)) is None:
                continue
            try:
                return self._decoder.decode(raw)
            except (msgspec.ValidationError, msgspec.DecodeError) as e:
                self.num_bad_msgs += 1
                logger.warning("%s: dropped a malformed message: %s", self._node_id, e)

    def wait(self, timeout_ms: int) -> None:
        """Sleep until a frame comes or ``timeout_ms`` passes."""
        self._pull.poll(timeout_ms)

    def close(self) -> None:
        self._pull.close(linger=0)


class ServerLink:
    """The PUSH socket to the server. While no server reads (it exited and a new one will
    attach), a message waits at most ``send_timeout_ms``, and later ones are dropped at once
    (``num_unsent_msgs``) until a send succeeds again."""

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

    def report(self, req: Req, new_tokens: list[int]) -> None:
        """``req``'s new tokens (and its end, if it ended)."""
        self.send(
            TokenMsg(
                request_id=req.request_id,
                token_ids=new_tokens,
                finished=req.is_finished,
                finish_reason=req.finish_reason,
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached_tokens,
                error=req.error,
                node_id=self._node_id,
            )
        )

    def report_error(self, request_id: str, error: str, can_retry: bool = False) -> None:
        """``can_retry``: the request itself is fine (its KV transfer or a peer failed)."""
        self.send(
            TokenMsg(
                request_id=request_id,
                token_ids=[],
                finished=True,
                finish_reason="abort",
                num_prompt_tokens=0,
                num_cached_tokens=0,
                error=error,
                node_id=self._node_id,
                can_retry=can_retry,
            )
        )

    def report_step(self, result: StepResult) -> None:
        """Tokens of the requests that produced one, errors of those that failed."""
        for req in result.failed:
            self.report_error(req.request_id, req.error or "failed")
        for req in result.produced:
            self.report(req, req.output_ids[-1:])

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
