"""The rendezvous of pair groups, carried over the sealed control channel: no store listens.

Gloo (and NCCL) build a group over a ``torch.distributed.Store``: each rank ``set``s what the
other needs (gloo: its listening address; NCCL: the unique id) and ``get``s the other's. Here
that store is a ``PairStore``, one per pair incarnation, on both ranks: a ``set`` lands in a
local ``HashStore`` and goes to the peer as a ``PairKeyMsg`` on the control plane (sealed,
counted, replay-proof, for one audience: ``auth.py``), and the peer's keys are written into the
local store as they come, where the blocked ``get`` finds them. So no TCP port serves the
rendezvous, and a process without the cluster secret can neither list, read nor write an entry:
it can only send frames that the control plane refuses.

Threads: the pair worker (``datapath.py``) builds the group, so ``set``/``get`` run on it;
``set`` only queues (``Rendezvous.take_outgoing``), and the node's loop, which owns the control
sockets, sends what is queued and ``deliver``s what comes, from ``TransferAgent.progress``.

A key is taken only from the peer the store was opened for: the ``TransferRequestMsg`` sender's
DEALER (its routing id) on the receiving side, the dialled endpoint on the sending side.
"""

from __future__ import annotations

import logging
import queue
import threading
from datetime import timedelta
from typing import NamedTuple

import torch.distributed as dist

from transfer.messages import PairKeyMsg

log = logging.getLogger(__name__)

MAX_KEYS = 64  # a pair's rendezvous needs a handful (gloo: one per rank and device)

Route = str | bytes  # the peer: its endpoint (we dialled it) or its DEALER's routing id


class Outgoing(NamedTuple):
    route: Route
    msg: PairKeyMsg


class PairStore(dist.Store):
    """One pair incarnation's store (see the module docstring). ``get`` and ``wait`` block up
    to ``timeout_s`` for the peer's keys; the ops a pair's rendezvous does not use (``add``,
    ``compare_set``, ...) raise."""

    def __init__(self, prefix: str, timeout_s: float, outbox: queue.SimpleQueue[PairKeyMsg]):
        super().__init__()
        self.prefix = prefix
        self._timeout = timedelta(seconds=timeout_s)
        self._local = dist.HashStore()
        self._local.set_timeout(self._timeout)
        self._outbox = outbox
        self._num_keys = 0

    def set(self, key: str, value: bytes | str) -> None:  # type: ignore[override]
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._local.set(key, data)
        self._outbox.put(PairKeyMsg(group_prefix=self.prefix, key=key, value=data))

    def get(self, key: str) -> bytes:  # type: ignore[override]
        return self._local.get(key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
        self._local.wait(keys, timeout or self._timeout)

    def check(self, keys: list[str]) -> bool:  # type: ignore[override]
        return self._local.check(keys)

    def num_keys(self) -> int:  # type: ignore[override]
        return self._local.num_keys()

    def deliver(self, key: str, value: bytes) -> bool:
        """The peer set ``key``. False (ignored) past ``MAX_KEYS``."""
        if self._num_keys >= MAX_KEYS:
            return False
        self._num_keys += 1
        self._local.set(key, value)
        return True

    def _unsupported(self, *args: object) -> None:
        raise RuntimeError(f"pair store {self.prefix}: only set/get/wait/check are carried")

    add = compare_set = delete_key = _unsupported  # type: ignore[assignment]


class _Open(NamedTuple):
    store: PairStore
    route: Route
    outbox: queue.SimpleQueue[PairKeyMsg]


class Rendezvous:
    """The pair stores of one agent whose rendezvous is under way, by group prefix. ``open``
    and ``close`` may come from any thread; ``deliver`` and ``take_outgoing`` from the loop."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._open: dict[str, _Open] = {}
        self._closing: list[_Open] = []  # closed, their last keys maybe not sent yet
        self._lock = threading.Lock()
        self.num_stray_keys = 0  # authentic keys for no open store (late, or the wrong peer)

    @property
    def num_open(self) -> int:
        return len(self._open)

    def open(self, prefix: str, route: Route) -> PairStore:
        outbox: queue.SimpleQueue[PairKeyMsg] = queue.SimpleQueue()
        store = PairStore(prefix, self._timeout_s, outbox)
        with self._lock:
            if (old := self._open.pop(prefix, None)) is not None:  # a broken pair's, rebuilt
                self._closing.append(old)
            self._open[prefix] = _Open(store, route, outbox)
        return store

    def close(self, prefix: str) -> None:
        """The group is built (or failed): later keys for it are strays. What its store
        queued still goes out (``take_outgoing``): the peer may be waiting for it."""
        with self._lock:
            entry = self._open.pop(prefix, None)
            if entry is not None:
                self._closing.append(entry)

    def deliver(self, route: Route, msg: PairKeyMsg) -> None:
        with self._lock:
            entry = self._open.get(msg.group_prefix)
        if entry is None or entry.route != route or not entry.store.deliver(msg.key, msg.value):
            self.num_stray_keys += 1
            log.info("dropped a rendezvous key for %s (no such rendezvous here)", msg.group_prefix)

    def take_outgoing(self) -> list[Outgoing]:
        """Keys the stores set since the last call, with the peer each goes to."""
        with self._lock:
            entries = [*self._open.values(), *self._closing]
            self._closing = []
        out = []
        for entry in entries:
            while True:
                try:
                    out.append(Outgoing(entry.route, entry.outbox.get_nowait()))
                except queue.Empty:
                    break
        return out
