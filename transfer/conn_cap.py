"""``ConnectionCap``: at most ``max_conns`` TCP connections on a bound zmq socket at once.

libzmq queues up to ``RCVHWM`` frames per connection and accepts any number of connections, so
what strangers can make a receiver hold grows with the connections they open: per connection
``RCVHWM + 1`` frames (the queue, and the one frame its engine decoded and holds until the
queue has room) of up to the size limit each. libzmq has no cap on connections; this class is
one:

1. ``ConnectionCap(sock, ...)`` before ``sock`` binds: it sets the socket's ``RCVHWM`` to
   ``RCVHWM_FRAMES`` and its ``LINGER`` to 0, and the socket's monitor reports each TCP
   connection it accepts (with its file descriptor) and each it closes.
2. ``start(port)`` after the bind: a thread reads those reports. A connection is a stranger's
   until it proves membership: the socket's ``SealedReader`` ``vouch``es for the descriptor
   (libzmq's ``SRCFD``) of each connection that delivered a frame sealed under the cluster
   secret. Past ``max_conns`` open, a stranger's connection is cut, never a member's: the
   oldest of the peer host that holds the most strangers' connections, or the newcomer itself
   while ``max_conns`` cut ones still hold their frames. A cut is ``shutdown(2)`` on (a
   duplicate of) the descriptor, after checking it is a TCP connection to ``port`` (a
   descriptor libzmq closed meanwhile may have been reused). libzmq hands the reader what the
   connection queued, then sees the peer gone and drops it: a cut one holds its frames until
   then, so it counts until libzmq reports it closed.
3. ``close()`` before the socket closes.

So the socket holds at most ``2 * max_conns * (RCVHWM_FRAMES + 1)`` frames
(``max_queued_bytes``: the open connections' and the cut ones' not yet read), plus what a
newcomer cut at once sends in the moment before (the thread cuts it within milliseconds).
Strangers holding every place cannot keep a member out nor cut it: a member that joins (a
replacement node, a reconnect) pushes out a stranger, and its first sealed frame makes it a
member. Until that frame is read it is a stranger to the cap: strangers on other hosts cannot
have it cut (their host holds more strangers' connections: theirs go first), strangers on its
own host can, by opening ``max_conns`` connections before it is read. A member's frame read
after its connection closed and its descriptor went to a new connection vouches for that one:
a place held, not a member cut.
"""

from __future__ import annotations

import enum
import logging
import os
import socket
import threading
import uuid
from collections import Counter
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
    """The most a capped socket holds in queued frames: its open connections' and the cut ones'
    not yet read (not counting newcomers in the milliseconds before they are cut)."""
    return 2 * max_conns * (RCVHWM_FRAMES + 1) * max_frame_bytes


class _Conn(enum.Enum):
    STRANGER = enum.auto()  # let in, no authentic frame yet
    MEMBER = enum.auto()  # delivered an authentic frame: never cut
    CUT = enum.auto()  # shut down, not yet reported closed: may still hold frames


class ConnectionCap:
    """Cuts connections to ``sock`` beyond ``max_conns`` open at once (module docstring)."""

    def __init__(self, sock: zmq.Socket[Any], max_conns: int, what: str) -> None:
        if max_conns < 1:
            raise ValueError(f"max_conns must be >= 1, got {max_conns}")
        sock.setsockopt(zmq.RCVHWM, RCVHWM_FRAMES)
        sock.setsockopt(zmq.LINGER, 0)  # closing the socket drops what it queued
        self.max_conns = max_conns
        self.what = what  # the socket, for the log
        self.num_cut = 0  # strangers' connections cut (over the cap)
        self._sock = sock
        addr = f"inproc://pd-conn-cap-{uuid.uuid4().hex}"
        sock.monitor(addr, _EVENTS)
        # the monitor is read on the cap's thread: a socket of its own (a plain one, whatever
        # kind of context ``sock`` has: asyncio's too), in the same libzmq context
        self._events = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
        self._events.connect(addr)
        # the connections libzmq holds, by descriptor, oldest first
        self._open: dict[int, _Conn] = {}
        self._hosts: dict[int, str] = {}  # their peers' addresses, by descriptor
        self._lock = threading.Lock()  # ``_open``: the cap's thread and the reader's
        self._port = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"conn-cap {what}", daemon=True)

    @property
    def num_open(self) -> int:
        """Connections let in and not cut."""
        with self._lock:
            return sum(state is not _Conn.CUT for state in self._open.values())

    @property
    def num_members(self) -> int:
        """Open connections that delivered an authentic frame."""
        with self._lock:
            return sum(state is _Conn.MEMBER for state in self._open.values())

    def start(self, port: int) -> None:
        """Cut from now on (reports since the constructor are read first); ``port``: where
        ``sock`` listens."""
        self._port = port
        self._thread.start()

    def vouch(self, fd: int) -> None:
        """The connection on descriptor ``fd`` delivered an authentic frame: a member's, never
        cut from now on. From the socket's reader, on any thread."""
        with self._lock:
            if self._open.get(fd) is _Conn.STRANGER:
                self._open[fd] = _Conn.MEMBER

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._events.poll(100):
                continue
            # every report queued, in order, before cutting: a descriptor reported closed is
            # not cut under the number of another connection
            events = []
            while True:
                try:
                    events.append(parse_monitor_message(self._events.recv_multipart(zmq.NOBLOCK)))
                except zmq.Again:
                    break
            for fd in self._admit(events):
                self._cut(fd)

    def _admit(self, events: list[dict[str, Any]]) -> list[int]:
        """Applies the monitor's reports; the connections to cut, past ``max_conns`` open:
        strangers', from the host that holds the most of them, its oldest first; the newest
        while ``max_conns`` cut ones are not closed yet."""
        with self._lock:
            accepted = []
            for event in events:
                fd = int(event["value"])
                self._open.pop(fd, None)  # an accepted one is re-added as the newest
                self._hosts.pop(fd, None)
                if event["event"] == zmq.EVENT_ACCEPTED:
                    self._open[fd] = _Conn.STRANGER
                    accepted.append(fd)
            for fd in accepted:
                if fd in self._open:
                    self._hosts[fd] = _peer_host(fd)
            num_cut = sum(state is _Conn.CUT for state in self._open.values())
            over = len(self._open) - num_cut - self.max_conns
            strangers = [fd for fd, state in self._open.items() if state is _Conn.STRANGER]
            victims = []
            while over > 0 and strangers:
                if num_cut < self.max_conns:
                    per_host = Counter(self._hosts[fd] for fd in strangers)
                    most = max(per_host.values())
                    victim = next(fd for fd in strangers if per_host[self._hosts[fd]] == most)
                else:
                    victim = strangers[-1]
                strangers.remove(victim)
                victims.append(victim)
                num_cut += 1
                over -= 1
            for fd in victims:
                self._open[fd] = _Conn.CUT
        return victims

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
                "%s: %d connections open, the most it takes: cut %d strangers' so far",
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


def _peer_host(fd: int) -> str:
    """The address of the peer of the TCP connection on descriptor ``fd`` ("" when unknown)."""
    try:
        dup = os.dup(fd)
    except OSError:  # closed meanwhile
        return ""
    try:
        conn = socket.socket(fileno=dup)  # owns the duplicate only
    except OSError:  # not a socket (any more)
        os.close(dup)
        return ""
    with conn:
        try:
            return str(conn.getpeername()[0])
        except (OSError, IndexError, TypeError):
            return ""
