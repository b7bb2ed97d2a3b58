"""What the server hears from a node, and how other threads reach its loop.

``Heartbeat``: each loop iteration sends the cache's events; every ``stats_interval_s`` it
sends the node's stats, which are its heartbeat (the server declares a node dead when they stop
for ``heartbeat_timeout_s``). A long forward pass beats between its decoder layers (``beat``,
the engine's layer callback), so a busy loop is told from a stuck one.

``LoopCommands``: the Ray actor's calls, queued and run on the loop thread between steps, so
no engine state is touched from two threads.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec

from pd.engine.core import EngineCore
from pd.node.links import Inbox, PeerLinks, ServerLink
from pd.node.pulls import PullSource
from pd.node.role import BaseRole
from transfer.agent import TransferAgent
from transfer.inbound import merge_top


def _resident_bytes() -> int:
    """This process's resident memory (Linux; 0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class NodeResources(NamedTuple):
    """What a node holds open; leak checks compare these with their idle level."""

    num_pairs: int  # pair groups (as sender and as receiver)
    num_sockets: int  # zmq sockets: inbox, server link, peer links, transfer control
    num_threads: int  # Python threads of the process (pair workers and copiers among them)
    num_transfers: int  # transfers not yet final

    @classmethod
    def measure(cls, transfer: TransferAgent, peers: PeerLinks) -> NodeResources:
        """What a node with this transfer agent and these peer links holds open now."""
        return cls(
            num_pairs=transfer.num_pairs,
            num_sockets=2 + len(peers) + transfer.num_sockets,
            num_threads=threading.active_count(),
            num_transfers=transfer.num_open_transfers,
        )


class Heartbeat:
    """A node's cache events and stats, sent to the server from its loop thread."""

    def __init__(
        self,
        stats_interval_s: Callable[[], float],
        role_name: str,
        core: EngineCore,
        role: BaseRole,
        inbox: Inbox,
        server: ServerLink,
        transfer: TransferAgent,
        peers: PeerLinks,
        pull_source: PullSource,
    ) -> None:
        self._stats_interval_s = stats_interval_s  # read at each beat: the node's config
        self.role_name = role_name
        self.core = core
        self.role = role
        self.inbox = inbox
        self.server = server
        self.transfer = transfer
        self.peers = peers
        self.pull_source = pull_source
        self._next_stats = 0.0

    def publish(self) -> None:
        """The loop's last call of an iteration: the cache's events, and stats if it is time."""
        self.server.send_all(self.core.cache.take_events())
        if time.monotonic() >= self._next_stats:
            self.send_stats()

    def beat(self, layer: int) -> None:
        """A decoder layer finished (the engine's layer callback): let the role do what cannot
        wait (``between_layers``), and beat if it is time."""
        self.role.between_layers()
        if time.monotonic() >= self._next_stats:
            self.send_stats()

    @property
    def num_rejected_msgs(self) -> int:
        """Frames that failed authentication, on the inbox and the transfer socket."""
        return self.inbox.num_rejected_msgs + self.transfer.num_rejected_msgs

    def send_stats(self) -> None:
        self._next_stats = time.monotonic() + self._stats_interval_s()
        counters = self.role.transfer_counters()._replace(
            num_dropped_msgs=self.inbox.num_bad_msgs + self.transfer.num_dropped_msgs
        )
        res = NodeResources.measure(self.transfer, self.peers)
        stats = self.core.stats(self.role_name, counters)
        self.server.send(
            msgspec.structs.replace(
                stats,
                num_rejected_msgs=self.num_rejected_msgs,
                rejected_by_peer=merge_top(self.inbox.rejects.top(), self.transfer.rejects.top()),
                num_pairs=res.num_pairs,
                num_sockets=res.num_sockets,
                num_threads=res.num_threads,
                rss_bytes=_resident_bytes(),
                num_pulls_served=self.pull_source.num_served,
                num_transfer_retries=self.transfer.num_retries,
                num_held_transfers=self.transfer.num_held_requests,
                **self.role.stats_fields(),
            )
        )


class LoopCommands:
    """Calls from other threads, run on the loop thread between steps."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], queue.SimpleQueue[Any]]] = (
            queue.SimpleQueue()
        )

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """Queue ``fn`` for the loop thread and wait for its result (its exception raised)."""
        done: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._queue.put((fn, done))
        result = done.get(timeout=timeout)
        if isinstance(result, BaseException):
            raise result
        return result

    def run_pending(self) -> None:
        """On the loop thread: run every queued call, handing each its result or exception."""
        while True:
            try:
                fn, done = self._queue.get_nowait()
            except queue.Empty:
                return
            try:
                done.put(fn())
            except Exception as e:  # handed to the caller
                done.put(e)
