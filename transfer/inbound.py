"""Reading sealed frames off a zmq socket within bounds no sender can move.

Every socket in the cluster that receives (a node's inbox, the server's PULL, a transfer
ROUTER and its DEALERs) reads through a ``SealedReader``:

- **size**: ``limit_frame_size`` sets ``zmq.MAXMSGSIZE`` before the socket binds or connects.
  libzmq reads a frame's length from its header and drops a longer frame, and the connection
  that sent it, before allocating anything. libzmq reports no reason (a monitor sees only a
  disconnect), so these frames are not counted.
- **work per call**: ``read()`` takes at most ``ReadBudget.max_frames`` frames or
  ``max_bytes`` bytes, authentic or not, then returns: the caller's loop (a node's step and
  heartbeat, the server's event loop) gets its turn between batches, whatever is queued.
- **who**: a frame the ``Opener`` refuses is counted against the TCP address that sent it
  (``RejectsByPeer``: the ``max_peers`` addresses with the most, in bounded memory).

- **connections**: a bound socket takes at most ``max_conns`` connections at once, each
  queueing at most ``RCVHWM_FRAMES`` frames (``conn_cap.py``); the reader vouches to the cap
  for each connection that delivered an authentic frame (its descriptor, libzmq's ``SRCFD``),
  which the cap never cuts.
- **a short queue, read at speed**: once ``read()`` took a frame, it waits up to
  ``REFILL_WAIT_MS`` for the next one before it returns: libzmq refills a connection's short
  queue while we read, and a burst of a peer's messages is read in one call, not a few frames
  per call.

What a stranger can make a receiver hold is then bounded by the connections it takes times
their queues times the size limit (``conn_cap.max_queued_bytes``).

The size limit (``max_frame_bytes``) is sized from the largest legitimate frame: one that
carries a list of token (or slot) ids as long as a request can be, ``max_tokens`` (a prompt of
``max_model_len`` tokens in a ``PrefillReqMsg``, a cache path in a snapshot's
``CacheEventMsg``, a ``TransferRequestMsg``'s token ids, a ``TransferReadyMsg``'s slots).
msgpack spends at most 5 bytes on an id below 2**32; ``FRAME_MARGIN_BYTES`` covers the rest
with room (the sampling parameters the server accepts with its default limits, 32 stop strings
of 1,024 characters, 1,024 stop token ids and 1,024 logit biases, take < 200 KiB).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import zmq

from transfer.auth import OVERHEAD_BYTES, Opener
from transfer.conn_cap import ConnectionCap

log = logging.getLogger(__name__)

MAX_ID_BYTES = 5  # msgpack's uint32: a token or slot id
FRAME_MARGIN_BYTES = 1 << 20
# What a socket is sized for when it cannot know the context length (the server binds before
# its nodes tell theirs): 128 Ki tokens, so ~1.6 MiB.
DEFAULT_MAX_TOKENS = 1 << 17
# Once a read took a frame, how long it waits for libzmq to refill a connection's short queue.
REFILL_WAIT_MS = 1


def max_frame_bytes(max_tokens: int) -> int:
    """The largest frame a socket takes in a cluster whose requests hold at most
    ``max_tokens`` tokens (see the module docstring)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    return OVERHEAD_BYTES + FRAME_MARGIN_BYTES + MAX_ID_BYTES * max_tokens


def limit_frame_size(sock: zmq.Socket[Any], max_bytes: int) -> None:
    """Frames longer than ``max_bytes`` are dropped by libzmq before they are allocated (the
    sender is disconnected). Only before ``bind``/``connect``: libzmq copies it then."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)


class ReadBudget(NamedTuple):
    """What one ``SealedReader.read`` call may take (it takes at least one frame)."""

    max_frames: int = 256
    max_bytes: int = 16 << 20


class RejectsByPeer:
    """Refused frames per sending TCP address, in bounded memory: the ``max_peers`` addresses
    with the most are kept exactly while at most ``2 * max_peers`` are tracked, then the
    tracked set is cut back to the top ``max_peers`` (a newcomer starts again from 1)."""

    def __init__(self, what: str, max_peers: int = 8) -> None:
        self.what = what  # the receiver, for the log
        self.max_peers = max_peers
        self._counts: dict[str, int] = {}

    def add(self, peer: str) -> None:
        n = self._counts.get(peer, 0) + 1
        self._counts[peer] = n
        if n & (n - 1) == 0:  # 1, 2, 4, ...: a flood cannot flood the log
            log.warning("%s: refused %d frames from %s so far", self.what, n, peer)
        if len(self._counts) > 2 * self.max_peers:
            self._counts = dict(self._top(self._counts.items()))

    def top(self) -> dict[str, int]:
        """The ``max_peers`` addresses that sent the most refused frames, with their counts."""
        return dict(self._top(self._counts.items()))

    def _top(self, items: Any) -> list[tuple[str, int]]:
        return sorted(items, key=lambda kv: (-kv[1], kv[0]))[: self.max_peers]


def merge_top(*maps: dict[str, int], max_peers: int = 8) -> dict[str, int]:
    """Counts per address of several receivers, summed, the ``max_peers`` largest kept."""
    total: dict[str, int] = {}
    for m in maps:
        for peer, n in m.items():
            total[peer] = total.get(peer, 0) + n
    return dict(sorted(total.items(), key=lambda kv: (-kv[1], kv[0]))[:max_peers])


class Received(NamedTuple):
    payload: bytes  # the opened frame: authentic, fresh, first seen
    identity: bytes | None  # a ROUTER's: the DEALER that sent it


class SealedReader:
    """Reads ``sock`` (a PULL or DEALER: one part per message; a ROUTER: identity + frame),
    opening each frame with ``opener``, and vouching to ``cap`` (the socket's, where it binds
    one) for each connection that delivered an authentic frame. Not thread-safe (nor is the
    socket)."""

    def __init__(
        self,
        sock: zmq.Socket[Any],
        opener: Opener,
        rejects: RejectsByPeer,
        budget: ReadBudget,
        cap: ConnectionCap | None = None,
    ) -> None:
        self._sock = sock
        self._cap = cap
        self._opener = opener
        self._rejects = rejects
        self._budget = budget
        self._is_router = sock.type == zmq.ROUTER
        self.num_bad_parts = 0  # messages with the wrong number of parts (dropped)
        self._num_refused_last = 0  # frames the last ``read`` refused, and opened
        self._num_opened_last = 0

    @property
    def is_flooded(self) -> bool:
        """The last ``read`` refused every frame it took: junk is coming, and waiting for the
        socket to be readable would return at once (a loop that did would spin on it)."""
        return self._num_refused_last > 0 and not self._num_opened_last

    @property
    def num_rejected(self) -> int:
        """Frames refused so far: by the opener (forged, replayed, ...) or not one frame; not
        those sealed before the opener's epoch (``num_before_epoch``)."""
        drops = self._opener.drops
        return drops.total - drops.num_before_epoch + self.num_bad_parts

    @property
    def num_before_epoch(self) -> int:
        """Authentic frames sealed before this reader's opener was made, dropped: a member's
        queued while this socket was not bound (a node's heartbeats to a server that starts
        again, say), never a stranger's, so neither counted as rejected nor by sender."""
        return self._opener.drops.num_before_epoch

    def read(self) -> list[Received]:
        """The authentic payloads among the next frames queued, reading at most the budget;
        nothing blocks. Frames the opener refuses are counted by it and by sender."""
        out: list[Received] = []
        max_frames, max_bytes = self._budget
        num_frames = num_bytes = 0
        while num_frames < max_frames and num_bytes < max_bytes:
            try:
                parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if not num_frames or not self._sock.poll(REFILL_WAIT_MS):
                    break
                continue
            num_frames += 1
            num_bytes += sum(len(p) for p in parts)
            if len(parts) != (2 if self._is_router else 1):
                self.num_bad_parts += 1
                self._rejects.add(_peer(parts[-1]))
                continue
            frame = parts[-1]
            before = self._opener.drops.num_before_epoch
            if (payload := self._opener.open(frame.buffer)) is None:
                if self._opener.drops.num_before_epoch == before:
                    self._rejects.add(_peer(frame))
                continue
            if self._cap is not None and (fd := _source_fd(frame)) >= 0:
                self._cap.vouch(fd)
            out.append(Received(payload, parts[0].bytes if self._is_router else None))
        self._num_refused_last, self._num_opened_last = num_frames - len(out), len(out)
        return out


def _peer(frame: zmq.Frame) -> str:
    try:
        return frame.get("Peer-Address")  # type: ignore[no-any-return]
    except zmq.ZMQError:  # not a TCP connection (inproc, ipc)
        return "?"


def _source_fd(frame: zmq.Frame) -> int:
    """The descriptor of the connection ``frame`` came on; -1 for none (inproc, ipc)."""
    try:
        return frame.get(zmq.SRCFD)  # type: ignore[no-any-return]
    except zmq.ZMQError:
        return -1
