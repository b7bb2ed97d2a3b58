"""The control plane: one zmq ROUTER per node (peers send to it), one DEALER per peer this
node sends to. Every call is non-blocking. Every frame is sealed under the cluster secret
(``auth.py``): one that fails authentication is counted in ``num_rejected``, one that is
authentic but not a valid ``ControlMsg`` in ``num_dropped``; either is dropped and the loop
goes on."""

from __future__ import annotations

import logging
from typing import NamedTuple

import msgspec
import zmq

from transfer.auth import DEFAULT_MAX_AGE_S, Opener, Sealer, reply_audience
from transfer.endpoint import parse_endpoint
from transfer.messages import ControlMsg, decode_msg, encode_msg

log = logging.getLogger(__name__)


class Incoming(NamedTuple):
    msg: ControlMsg
    identity: bytes | None  # set for frames on the ROUTER (a peer that dialled us)
    peer: str | None  # set for frames on a DEALER (the endpoint we dialled)


class _Dealer(NamedTuple):
    sock: zmq.Socket[bytes]
    sealer: Sealer  # to the peer's ROUTER
    opener: Opener  # its replies


class ControlPlane:
    """Sockets of one node. Not thread-safe: only the node's own thread may call it.

    ``host`` must be an address peers can dial: the ROUTER binds it and advertises it."""

    def __init__(
        self,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        max_queued: int = 10_000,
        max_msg_age_s: float = DEFAULT_MAX_AGE_S,
    ) -> None:
        self._ctx = zmq.Context.instance()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.SNDHWM, max_queued)
        if port:
            self._router.bind(f"tcp://{host}:{port}")
        else:
            port = self._router.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._secret, self._max_age_s = secret, max_msg_age_s
        self._opener = Opener(secret, self.endpoint, max_msg_age_s)
        self._reply_sealer = Sealer(secret, reply_audience(self.endpoint))
        self._dealers: dict[str, _Dealer] = {}
        self._max_queued = max_queued
        self.num_dropped = 0  # authentic but malformed, or undeliverable frames
        self._num_rejected_gone = 0  # rejected by the openers of dealers since closed

    @property
    def num_rejected(self) -> int:
        """Frames that failed authentication (forged, altered, replayed, stale)."""
        dealers = sum(d.opener.drops.total for d in self._dealers.values())
        return self._opener.drops.total + dealers + self._num_rejected_gone

    def send(self, peer: str, msg: ControlMsg) -> bool:
        """To the ROUTER at ``peer`` (connecting on first use). False if it could not queue;
        ValueError if ``peer`` is not a ``tcp://host:port`` to dial."""
        dealer = self._dealers.get(peer)
        if dealer is None:
            parse_endpoint(peer)
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self._max_queued)
            sock.connect(peer)
            opener = Opener(self._secret, reply_audience(peer), self._max_age_s)
            dealer = self._dealers[peer] = _Dealer(sock, Sealer(self._secret, peer), opener)
        return self._try_send(dealer.sock, [dealer.sealer.seal(encode_msg(msg))], peer)

    def reply(self, identity: bytes, msg: ControlMsg) -> bool:
        """To a peer that dialled our ROUTER."""
        frame = self._reply_sealer.seal(encode_msg(msg))
        return self._try_send(self._router, [identity, frame], identity.hex())

    @property
    def num_sockets(self) -> int:
        return 1 + len(self._dealers)

    def forget(self, peer: str) -> None:
        if (dealer := self._dealers.pop(peer, None)) is not None:
            self._num_rejected_gone += dealer.opener.drops.total
            dealer.sock.close(linger=0)

    def recv_all(self, max_msgs: int = 1000) -> list[Incoming]:
        """Every frame waiting now (up to ``max_msgs``), without blocking."""
        out: list[Incoming] = []
        while len(out) < max_msgs and (frames := self._recv(self._router)) is not None:
            if len(frames) != 2:
                self._drop(f"ROUTER frame count {len(frames)} != 2")
                continue
            if (msg := self._decode(self._opener, frames[1])) is not None:
                out.append(Incoming(msg, frames[0], None))
        for peer, dealer in self._dealers.items():
            while len(out) < max_msgs and (frames := self._recv(dealer.sock)) is not None:
                if len(frames) != 1:
                    self._drop(f"DEALER frame count {len(frames)} != 1 from {peer}")
                    continue
                if (msg := self._decode(dealer.opener, frames[0])) is not None:
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

    def _decode(self, opener: Opener, frame: bytes) -> ControlMsg | None:
        if (data := opener.open(frame)) is None:
            return None
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
