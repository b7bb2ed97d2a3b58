"""The disk tier's writer thread: the chunks queued by the engine's step (``pd.cache.
disk_tier``), each written to a temporary name and renamed in once the directory has room
(``pd.cache.disk_dir``).

1. ``submit`` queues a chunk (the step never waits for the disk); with ``MAX_PENDING_WRITES``
   queued, or while writes are held back, it is skipped and counted.
2. The thread asks ``DiskDir.room_for`` whether the file system keeps its floor after the
   chunk; if not, writes are held back (``HoldBack``), and the chunks already queued are
   dropped unwritten.
3. A full disk anyway (ENOSPC, EDQUOT: another writer won the race) holds writes back too;
   any other error (or a bug) goes to ``on_error``, which turns the tier off.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pd.cache.chunk_file import chunk_bytes
from pd.cache.disk_dir import CHUNK_SUFFIX, TMP_PREFIX, DiskDir, unlink_if_there

MAX_PENDING_WRITES = 64  # chunks queued for the writer thread; more are skipped
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # writes are held back; the tier stays on
logger = logging.getLogger(__name__)


class HoldBack:
    """Writes held back once the file system is at its floor (or full): for ``first_s``,
    doubling up to ``most_s`` while it stays there; the first write after that checks again,
    and one that finds room ends it. A full disk costs a check per period, not per chunk."""

    def __init__(self, first_s: float = 1.0, most_s: float = 60.0) -> None:
        self.first_s, self.most_s = first_s, most_s
        self._period_s = first_s
        self._until = 0.0

    @property
    def is_holding(self) -> bool:
        return time.monotonic() < self._until

    def hold(self) -> bool:
        """Hold writes back for the next period; True if they were not held back before."""
        first = self._period_s == self.first_s
        self._until = time.monotonic() + self._period_s
        self._period_s = min(2 * self._period_s, self.most_s)
        return first

    def clear(self) -> None:
        self._period_s = self.first_s


class WriteCounts:
    def __init__(self) -> None:
        self.written = self.skipped = self.failed = self.held = 0


class ChunkWriter:
    """One thread writing the chunks of ``key`` into ``store``'s subdirectory ``dir``."""

    def __init__(
        self, store: DiskDir, key: str, dir: Path, on_error: Callable[[str], None]
    ) -> None:
        self.store, self.key, self.dir = store, key, dir
        self.on_error = on_error
        self.counts = WriteCounts()
        self.hold_back = HoldBack()
        self._lock = threading.Lock()
        self._pending: dict[Path, tuple[str, list[int], bytes]] = {}  # file -> its chunk
        self._queue: queue.Queue[Path | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def is_queued(self, target: Path) -> bool:
        with self._lock:
            return target in self._pending

    def submit(self, target: Path, namespace: str, path: list[int], payload: bytes) -> None:
        with self._lock:
            if target in self._pending:
                return
            if self.hold_back.is_holding:
                self.counts.held += 1
                return
            if len(self._pending) >= MAX_PENDING_WRITES:
                self.counts.skipped += 1
                return
            self._pending[target] = (namespace, path, payload)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="pd-disk-tier", daemon=True)
            self._thread.start()
        self._queue.put(target)

    def flush(self) -> None:
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while True:
            target = self._queue.get()
            try:
                if target is None:
                    return
                with self._lock:
                    namespace, path, payload = self._pending[target]
                try:
                    if self.hold_back.is_holding:  # queued before the disk was found full
                        with self._lock:
                            self.counts.held += 1
                    else:
                        self._write(target, namespace, path, payload)
                except OSError as e:
                    if e.errno in _DISK_FULL:  # the chunk is not kept; writes are held back
                        logger.warning("disk tier: writing %s failed: %s", target.name, e)
                        self.hold_back.hold()
                        with self._lock:
                            self.counts.failed += 1
                    else:
                        self.on_error(f"writing {target.name} failed: {e}")
                except Exception as e:  # a bug: the tier stops rather than the writer thread
                    logger.exception("disk tier: writing %s failed", target.name)
                    self.on_error(f"writing {target.name} failed: {e!r}")
                finally:
                    with self._lock:
                        del self._pending[target]
            finally:
                self._queue.task_done()

    def _write(self, target: Path, namespace: str, path: list[int], payload: bytes) -> None:
        data = chunk_bytes(self.key, namespace, path, payload, self.store.tag)
        if not self.store.room_for(len(data)):
            if self.hold_back.hold():
                logger.warning(
                    "disk tier %s: the file system is at its free-space floor; writes are "
                    "held back until it has room", self.dir,
                )  # fmt: skip
            with self._lock:
                self.counts.held += 1
            return
        self.hold_back.clear()
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=TMP_PREFIX, suffix=CHUNK_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            kept = self.store.put(Path(tmp), target, len(data))
        finally:
            unlink_if_there(Path(tmp))  # gone if it was renamed in
        with self._lock:
            if kept:
                self.counts.written += 1
            else:  # larger than the whole bound
                self.counts.failed += 1
