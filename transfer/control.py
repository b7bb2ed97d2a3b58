"""The control plane: one zmq ROUTER per node (peers send to it), one DEALER per peer this
node sends to. Every call is non-blocking; frames that are not a valid ``ControlMsg`` are
logged, counted and dropped, and the loop goes on."""

from __future__ import annotations

import logging
from typing import NamedTuple

import msgspec
import zmq

from transfer.messages import ControlMsg, decode_msg, encode_msg

log = logging.getLogger(__name__)


class Incoming(NamedTuple):
    msg: ControlMsg
    identity: bytes | None  # set for frames on the ROUTER (a peer that dialled us)
    peer: str | None  # set for frames on a DEALER (the endpoint we dialled)


class ControlPlane:
    """Sockets of one node. Not thread-safe: only the node's own thread may call it."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, max_queued: int = 10_000) -> None:
        self._ctx = zmq.Context.instance()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.SNDHWM, max_queued)
        if port:
            self._router.bind(f"tcp://{host}:{port}")
        else:
            port = self._router.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._max_queued = max_queued
        self.num_dropped = 0  # malformed or undeliverable frames

    def send(self, peer: str, msg: ControlMsg) -> bool:
        """To the ROUTER at ``peer`` (connecting on first use). False if it could not queue."""
        sock = self._dealers.get(peer)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self._max_queued)
            sock.connect(peer)
            self._dealers[peer] = sock
        return self._try_send(sock, [encode_msg(msg)], peer)

    def reply(self, identity: bytes, msg: ControlMsg) -> bool:
        """To a peer that dialled our ROUTER."""
        return self._try_send(self._router, [identity, encode_msg(msg)], identity.hex())

    @property
    def num_sockets(self) -> int:
        return 1 + len(self._dealers)

    def forget(self, peer: str) -> None:
        if (sock := self._dealers.pop(peer, None)) is not None:
            sock.close(linger=0)

    def recv_all(self, max_msgs: int = 1000) -> list[Incoming]:
        """Every frame waiting now (up to ``max_msgs``), without blocking."""
        out: list[Incoming] = []
        while len(out) < max_msgs and (frames := self._recv(self._router)) is not None:
            if len(frames) != 2:
                self._drop(f"ROUTER frame count {len(frames)} != 2")
                continue
            if (msg := self._decode(frames[1])) is not None:
                out.append(Incoming(msg, frames[0], None))
        for peer, sock in self._dealers.items():
            while len(out) < max_msgs and (frames := self._recv(sock)) is not None:
                if len(frames) != 1:
                    self._drop(f"DEALER frame count {len(frames)} != 1 from {peer}")
                    continue
                if (msg := self._decode(frames[0])) is not None:
                    out.append(Incoming(msg, None, peer))
        return out

    def close(self) -> None:
        for peer in list(self._dealers):
            self.forget(peer)
        self._router.close(linger=0)

    def _recv(self, sock: zmq.Socket[bytes]) -> list[bytes] | None:
        try:
            return sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def _decode(self, data: bytes) -> ControlMsg | None:
        try:
            return decode_msg(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            self._drop(f"malformed control message ({len(data)} bytes): {e}")
            return None

    def _try_send(self, sock: zmq.Socket[bytes], frames: list[bytes], to: str) -> bool:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
            return True
        except zmq.Again:
            self._drop(f"control queue to {to} is full")
            return False

    def _drop(self, why: str) -> None:
        self.num_dropped += 1
        log.warning("dropped: %s", why)
