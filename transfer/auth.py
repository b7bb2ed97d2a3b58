"""Authenticated frames: every zmq message in the cluster carries a MAC under one secret.

The launcher makes a per-cluster secret (``new_secret()``) and hands it to each node through
Ray (``TransferConfig.secret``); the server holds it too. Every socket that sends has a
``Sealer``, every socket that receives an ``Opener``; a frame that fails any check is dropped
and counted by reason (``AuthDrops``), never handed to a decoder.

Frame (big-endian):

    | bytes        | field                                                          |
    |--------------|----------------------------------------------------------------|
    | [0, 1)       | version (1)                                                    |
    | [1, 9)       | stream id: random per ``Sealer``                               |
    | [9, 17)      | counter: 1, 2, 3, ... per stream                               |
    | [17, 25)     | timestamp: sender's wall clock in us, never decreasing per stream |
    | [25, n-16)   | payload (the msgpack message)                                  |
    | [n-16, n)    | tag: HMAC-SHA256(secret, len(audience) + audience + [0, n-16))[:16] |

The audience is the endpoint the frame is meant for (a PULL's or ROUTER's advertised address;
``reply_audience(endpoint, routing_id)`` for what a ROUTER sends back to the one DEALER whose
routing id that is). It is not sent: the receiver puts its own in the MAC, so a frame captured
on its way to one socket is refused by every other one, a reply meant for one dealer included.

An ``Opener`` accepts a stream's frames only with increasing counters (one zmq connection
keeps a stream's order; one ``Sealer`` per sending socket keeps each receiver on one
connection per stream) and only within ``max_age_s`` of its own clock; it forgets a stream
``max_age_s`` after the stream's newest timestamp, when any replay of it is stale anyway. State
is only kept for frames whose tag checked, so strangers cannot grow it.

Its epoch: an ``Opener`` also refuses what was sealed before it was made (more than
``max_clock_skew_s`` before, by the sender's clock), so a process restarted at the same address
under the same secret does not take replays of its predecessor's traffic, which its empty
memory of streams could not tell from new frames. No legitimate frame is older than the socket
it is meant for: every address is announced only once its socket reads. This asks the members'
clocks to agree within ``max_clock_skew_s`` (NTP does far better); a sender behind by more has
its frames refused for that excess after the receiver starts, then accepted. (A DEALER's
replies need no epoch: their audience names its fresh random routing id.)

What the secret protects: a process that does not know it cannot inject, alter, replay or
redirect a message. What it does not: confidentiality (frames are not encrypted), and a member
of the cluster (anything holding the secret can say anything; nodes still check what they are
told, e.g. the shape of an address to dial).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

log = logging.getLogger(__name__)

VERSION = 1
MIN_SECRET_BYTES = 16
_HEADER = struct.Struct(">B8sQQ")  # version, stream id, counter, timestamp (us)
HEADER_BYTES = _HEADER.size  # 25
TAG_BYTES = 16
OVERHEAD_BYTES = HEADER_BYTES + TAG_BYTES
# Wide: a frame is judged when it is read, so one that waited in a socket's queue behind a long
# stall of its reader (a first-use kernel compile) must still pass; and clocks of machines
# differ. Replays inside the window are refused by the counters anyway.
DEFAULT_MAX_AGE_S = 300.0
# How far a sender's clock may lag the receiver's when the receiver starts (its epoch).
DEFAULT_MAX_CLOCK_SKEW_S = 2.0


def new_secret() -> bytes:
    """A fresh per-cluster secret."""
    return secrets.token_bytes(32)


def check_secret(secret: bytes) -> None:
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        n = len(secret) if isinstance(secret, bytes) else type(secret).__name__
        raise ValueError(f"the cluster secret must be >= {MIN_SECRET_BYTES} bytes, got {n}")


def reply_audience(endpoint: str, routing_id: bytes) -> str:
    """The audience of what a ROUTER bound at ``endpoint`` sends back to the DEALER whose
    routing id is ``routing_id`` (each DEALER sets a fresh random one)."""
    return f"reply:{endpoint}/{routing_id.hex()}"


class _Mac:
    """HMAC-SHA256 (RFC 2104) keyed, and fed the audience, once per socket. Each frame copies
    the two keyed hashlib states, half the cost of ``hmac.HMAC.copy`` on a small frame."""

    def __init__(self, secret: bytes, audience: str) -> None:
        check_secret(secret)
        key = secret if len(secret) <= 64 else hashlib.sha256(secret).digest()
        key = key.ljust(64, b"\0")
        aud = audience.encode()
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in key))
        self._inner.update(struct.pack(">H", len(aud)) + aud)
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))

    def tag(self, header: bytes | memoryview, payload: bytes | memoryview) -> bytes:
        inner = self._inner.copy()
        inner.update(header)
        inner.update(payload)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()[:TAG_BYTES]


class Sealer:
    """Seals what one socket sends to ``audience``. Not thread-safe (nor is the socket)."""

    def __init__(
        self, secret: bytes, audience: str, clock: Callable[[], float] = time.time
    ) -> None:
        self._mac = _Mac(secret, audience)
        self.audience = audience
        self.stream_id = secrets.token_bytes(8)
        self._counter = 0
        self._last_us = 0
        self._clock = clock

    def __repr__(self) -> str:
        return f"Sealer({self.audience!r}, stream={self.stream_id.hex()}, sent={self._counter})"

    def seal(self, payload: bytes) -> bytes:
        self._counter += 1
        self._last_us = max(self._last_us, int(self._clock() * 1e6))
        header = _HEADER.pack(VERSION, self.stream_id, self._counter, self._last_us)
        return b"".join((header, payload, self._mac.tag(header, payload)))


@dataclass
class AuthDrops:
    """Frames an ``Opener`` refused, by reason (cumulative)."""

    num_malformed: int = 0  # too short or an unknown version
    num_bad_tag: int = 0  # forged, altered, another cluster's, or meant for another socket
    num_stale: int = 0  # timestamp further than max_age_s from the receiver's clock
    num_replayed: int = 0  # counter not above the stream's newest
    num_before_epoch: int = 0  # sealed before this opener was made: a predecessor's, replayed

    @property
    def total(self) -> int:
        return (
            self.num_malformed
            + self.num_bad_tag
            + self.num_stale
            + self.num_replayed
            + self.num_before_epoch
        )


class _Seen(NamedTuple):
    counter: int
    timestamp_us: int


class Opener:
    """Checks what one socket receives as ``audience``. Not thread-safe (nor is the socket)."""

    def __init__(
        self,
        secret: bytes,
        audience: str,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        clock: Callable[[], float] = time.time,
        max_clock_skew_s: float = DEFAULT_MAX_CLOCK_SKEW_S,
    ) -> None:
        if max_age_s <= 0 or max_clock_skew_s < 0:
            raise ValueError(
                f"max_age_s must be > 0 and max_clock_skew_s >= 0, got {max_age_s}, "
                f"{max_clock_skew_s}"
            )
        self._mac = _Mac(secret, audience)
        self.audience = audience
        self._max_age_us = int(max_age_s * 1e6)
        self._clock = clock
        # the epoch: anything sealed before this (allowing for clock skew) is a replay
        self.epoch_us = int((clock() - max_clock_skew_s) * 1e6)
        self._seen: dict[bytes, _Seen] = {}  # stream id -> newest accepted frame
        self._next_purge_us = 0
        self.drops = AuthDrops()

    def __repr__(self) -> str:
        return f"Opener({self.audience!r}, streams={len(self._seen)}, drops={self.drops})"

    @property
    def num_streams(self) -> int:
        return len(self._seen)

    def open(self, frame: bytes | memoryview) -> bytes | None:
        """The payload of an authentic, fresh, first-seen frame; None (counted) otherwise."""
        if len(frame) < OVERHEAD_BYTES or frame[0] != VERSION:
            return self._drop("num_malformed", len(frame))
        view = memoryview(frame)
        payload = view[HEADER_BYTES:-TAG_BYTES]
        if not hmac.compare_digest(self._mac.tag(view[:HEADER_BYTES], payload), view[-TAG_BYTES:]):
            return self._drop("num_bad_tag", len(frame))
        _, stream, counter, ts_us = _HEADER.unpack_from(frame)
        now_us = int(self._clock() * 1e6)
        if abs(now_us - ts_us) > self._max_age_us:
            return self._drop("num_stale", len(frame))
        if ts_us < self.epoch_us:
            return self._drop("num_before_epoch", len(frame))
        seen = self._seen.get(stream)
        if seen is not None and counter <= seen.counter:
            return self._drop("num_replayed", len(frame))
        self._seen[stream] = _Seen(counter, ts_us)
        if now_us >= self._next_purge_us:
            self._purge(now_us)
        return payload.tobytes()

    def _purge(self, now_us: int) -> None:
        # A stream whose newest frame is older than the window can only be replayed stale.
        cutoff = now_us - self._max_age_us
        self._seen = {s: v for s, v in self._seen.items() if v.timestamp_us >= cutoff}
        self._next_purge_us = now_us + self._max_age_us // 4

    def _drop(self, reason: str, size: int) -> None:
        n = getattr(self.drops, reason) + 1
        setattr(self.drops, reason, n)
        if n & (n - 1) == 0:  # 1, 2, 4, 8, ...: a flood cannot flood the log
            log.warning(
                "%s: dropped a %d-byte frame (%s, %d so far)", self.audience, size, reason, n
            )
        return None
