"""``ConnectionCap``: at most ``max_conns`` TCP connections on a bound zmq socket at once.

libzmq queues up to ``RCVHWM`` frames per connection and accepts any number of connections, so
what strangers can make a receiver hold grows with the connections they open: per connection
``RCVHWM + 1`` frames (the queue, and the one frame its engine decoded and holds until the
queue has room) of up to the size limit each. libzmq has no cap on connections; this class is
one:

1. ``ConnectionCap(sock, ...)`` before ``sock`` binds: it sets the socket's ``RCVHWM`` to
   ``RCVHWM_FRAMES`` and its ``LINGER`` to 0, and the socket's monitor reports each TCP
   connection it accepts (with its file descriptor) and each it closes.
2. ``start(port)`` after the bind: a thread reads those reports. A connection that would be
   the ``max_conns + 1``-th open is cut at once: ``shutdown(2)`` on (a duplicate of) its
   descriptor, after checking it is a TCP connection to ``port`` (a descriptor libzmq closed
   meanwhile may have been reused). libzmq then sees the peer gone and drops the connection
   and, the socket's ``LINGER`` being 0, what it queued unread.
3. ``close()`` before the socket closes.

So the socket holds at most ``max_conns * (RCVHWM_FRAMES + 1)`` frames (``max_queued_bytes``),
plus what a connection over
the cap sends in the moment before it is cut (the thread cuts it within milliseconds). The
connections already open keep theirs: a stranger holding ``max_conns`` connections keeps new
peers out (they reconnect every 100 ms and are cut again), not the ones it found there.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
# The default cap: one connection per node of the cluster (the server's PULL), or per peer (a
# node's inbox and transfer port), and the server's.
MAX_CONNS = 32
# Frames queued per connection: 2 keeps a single sender's small messages at full speed (with 1,
# each frame waits for the reader to hand the connection its turn back: a quarter of the
# rate); the sender's own queue (its SNDHWM) holds the rest of a burst.
RCVHWM_FRAMES = 2


def max_queued_bytes(max_conns: int, max_frame_bytes: int) -> int:
    """The most a capped socket holds in queued frames (not counting the connections over the
    cap in the milliseconds before they are cut)."""
    return max_conns * (RCVHWM_FRAMES + 1) * max_frame_bytes


class ConnectionCap:
    """Cuts connections to ``sock`` beyond ``max_conns`` open at once (module docstring)."""

    def __init__(self, sock: zmq.Socket[Any], max_conns: int, what: str) -> None:
        if max_conns < 1:
            raise ValueError(f"max_conns must be >= 1, got {max_conns}")
        sock.setsockopt(zmq.RCVHWM, RCVHWM_FRAMES)
        sock.setsockopt(zmq.LINGER, 0)  # a cut connection's queued frames go with it
        self.max_conns = max_conns
        self.what = what  # the socket, for the log
        self.num_cut = 0  # connections cut (over the cap)
        self._sock = sock
        addr = f"inproc://pd-conn-cap-{uuid.uuid4().hex}"
        sock.monitor(addr, _EVENTS)
        # the monitor is read on the cap's thread: a socket of its own (a plain one, whatever
        # kind of context ``sock`` has: asyncio's too), in the same libzmq context
        self._events = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
        self._events.connect(addr)
        self._open: set[int] = set()  # descriptors of the connections let in and still open
        self._port = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"conn-cap {what}", daemon=True)

    @property
    def num_open(self) -> int:
        return len(self._open)

    def start(self, port: int) -> None:
        """Cut from now on (reports since the constructor are read first); ``port``: where
        ``sock`` listens."""
        self._port = port
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._events.poll(100):
                continue
            # every report queued, in order, before cutting: a descriptor reported closed is
            # not cut under the number of another connection
            accepted: list[int] = []
            while True:
                try:
                    event = parse_monitor_message(self._events.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
                fd = int(event["value"])
                if event["event"] == zmq.EVENT_ACCEPTED:
                    accepted.append(fd)
                elif fd in accepted:  # gone already
                    accepted.remove(fd)
                else:
                    self._open.discard(fd)
            for fd in accepted:
                if len(self._open) < self.max_conns:
                    self._open.add(fd)
                else:
                    self._cut(fd)

    def _cut(self, fd: int) -> None:
        try:
            dup = os.dup(fd)
        except OSError:  # closed meanwhile
            return
        try:
            conn = socket.socket(fileno=dup)  # owns the duplicate only
        except OSError:  # not a socket (any more)
            os.close(dup)
            return
        with conn:
            try:
                if conn.type != socket.SOCK_STREAM or conn.getsockname()[1] != self._port:
                    return  # another descriptor under the number now
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                return
        self.num_cut += 1
        if self.num_cut & (self.num_cut - 1) == 0:  # 1, 2, 4, ...: a flood cannot flood the log
            log.warning(
                "%s: %d connections open, the most it takes: cut %d newer so far",
                self.what,
                self.max_conns,
                self.num_cut,
            )

    def close(self) -> None:
        """Stop cutting; call from the thread that owns the socket, before closing it."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._sock.disable_monitor()
        self._events.close(linger=0)
