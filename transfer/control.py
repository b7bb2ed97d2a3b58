"""The control plane: one zmq ROUTER per node (peers send to it), one DEALER per peer this
node sends to. Every call is non-blocking. Every frame is sealed under the cluster secret
(``auth.py``): one that fails authentication is counted in ``num_rejected`` (and by sender,
``rejects``), one that is authentic but not a valid ``ControlMsg`` in ``num_dropped``; either
is dropped and the loop goes on.

Each DEALER sets a random routing id, and the ROUTER seals what it sends back for that id
(``reply_audience``), so a reply is accepted by the one DEALER it was meant for. Every socket
refuses frames over ``max_frame_bytes``, the ROUTER takes at most ``max_conns`` connections at
once (``conn_cap.py``), and ``recv_all`` reads a bounded batch per call (``inbound.py``)."""

from __future__ import annotations

import logging
import secrets
from typing import NamedTuple

import msgspec
import zmq

from transfer.auth import DEFAULT_MAX_AGE_S, Opener, Sealer, reply_audience
from transfer.conn_cap import MAX_CONNS, ConnectionCap
from transfer.endpoint import parse_endpoint
from transfer.inbound import (
    DEFAULT_MAX_TOKENS,
    ReadBudget,
    RejectsByPeer,
    SealedReader,
    limit_frame_size,
    max_frame_bytes,
)
from transfer.messages import ControlMsg, decode_msg, encode_msg

log = logging.getLogger(__name__)


class Incoming(NamedTuple):
    msg: ControlMsg
    identity: bytes | None  # set for frames on the ROUTER (a peer that dialled us)
    peer: str | None  # set for frames on a DEALER (the endpoint we dialled)


# A control message is small but for the token ids of a request or the slots of a reply; a
# progress() call reads at most this much (the node calls it once per loop iteration, and once
# per transfer it polls).
CONTROL_BUDGET = ReadBudget(max_frames=64, max_bytes=4 << 20)
MAX_REPLY_STREAMS = 1024  # sealers of replies kept (one per DEALER answered); oldest go first


class _Dealer(NamedTuple):
    sock: zmq.Socket[bytes]
    sealer: Sealer  # to the peer's ROUTER
    reader: SealedReader  # its replies, sealed for this dealer's routing id


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
        max_frame_size: int = max_frame_bytes(DEFAULT_MAX_TOKENS),
        max_conns: int = MAX_CONNS,
    ) -> None:
        self._ctx = zmq.Context.instance()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.SNDHWM, max_queued)
        limit_frame_size(self._router, max_frame_size)
        self._cap = ConnectionCap(self._router, max_conns, f"transfer {host}")
        if port:
            self._router.bind(f"tcp://{host}:{port}")
        else:
            port = self._router.bind_to_random_port(f"tcp://{host}")
        self._cap.start(port)
        self.endpoint = f"tcp://{host}:{port}"
        self._secret, self._max_age_s = secret, max_msg_age_s
        self._max_frame_size = max_frame_size
        self.rejects = RejectsByPeer(f"transfer {self.endpoint}")
        self._opener = Opener(secret, self.endpoint, max_msg_age_s)
        self._reader = SealedReader(
            self._router, self._opener, self.rejects, CONTROL_BUDGET, self._cap
        )
        self._reply_sealers: dict[bytes, Sealer] = {}  # by the routing id of the dealer
        self._dealers: dict[str, _Dealer] = {}
        self._max_queued = max_queued
        self.num_dropped = 0  # authentic but malformed, or undeliverable frames
        self._num_rejected_gone = 0  # rejected by the dealers since closed

    @property
    def num_rejected(self) -> int:
        """Frames that failed authentication (forged, altered, replayed, stale, or not even a
        frame of the right shape)."""
        dealers = sum(d.reader.num_rejected for d in self._dealers.values())
        return self._reader.num_rejected + dealers + self._num_rejected_gone

    def send(self, peer: str, msg: ControlMsg) -> bool:
        """To the ROUTER at ``peer`` (connecting on first use). False if it could not queue;
        ValueError if ``peer`` is not a ``tcp://host:port`` to dial."""
        dealer = self._dealers.get(peer)
        if dealer is None:
            parse_endpoint(peer)
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self._max_queued)
            routing_id = secrets.token_bytes(16)
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
            limit_frame_size(sock, self._max_frame_size)
            sock.connect(peer)
            # No epoch needed: no frame sealed before this dealer can name its fresh routing id
            # (and a peer whose clock lags ours must not lose its first replies).
            audience = reply_audience(peer, routing_id)
            opener = Opener(
                self._secret, audience, self._max_age_s, max_clock_skew_s=self._max_age_s
            )
            reader = SealedReader(sock, opener, self.rejects, CONTROL_BUDGET)
            dealer = _Dealer(sock, Sealer(self._secret, peer), reader)
            self._dealers[peer] = dealer
        return self._try_send(dealer.sock, [dealer.sealer.seal(encode_msg(msg))], peer)

    def reply(self, identity: bytes, msg: ControlMsg) -> bool:
        """To the peer whose DEALER (routing id ``identity``) dialled our ROUTER; sealed so
        that only that DEALER accepts it."""
        sealer = self._reply_sealers.pop(identity, None)
        if sealer is None:
            sealer = Sealer(self._secret, reply_audience(self.endpoint, identity))
            if len(self._reply_sealers) >= MAX_REPLY_STREAMS:  # a new stream is fine, later
                del self._reply_sealers[next(iter(self._reply_sealers))]
        self._reply_sealers[identity] = sealer  # the most recent last
        frame = sealer.seal(encode_msg(msg))
        return self._try_send(self._router, [identity, frame], identity.hex())

    @property
    def num_sockets(self) -> int:
        return 1 + len(self._dealers)

    def forget(self, peer: str) -> None:
        if (dealer := self._dealers.pop(peer, None)) is not None:
            self._num_rejected_gone += dealer.reader.num_rejected
            dealer.sock.close(linger=0)

    def recv_all(self) -> list[Incoming]:
        """What is waiting now, without blocking: at most ``CONTROL_BUDGET`` from the ROUTER
        and from each DEALER."""
        out: list[Incoming] = []
        for got in self._reader.read():
            if (msg := self._decode(got.payload)) is not None:
                out.append(Incoming(msg, got.identity, None))
        for peer, dealer in self._dealers.items():
            for got in dealer.reader.read():
                if (msg := self._decode(got.payload)) is not None:
                    out.append(Incoming(msg, None, peer))
        return out

    def close(self) -> None:
        for peer in list(self._dealers):
            self.forget(peer)
        self._cap.close()
        self._router.close(linger=0)

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
