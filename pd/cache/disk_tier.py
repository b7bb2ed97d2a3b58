"""The disk tier: KV chunks in a directory, bounded in bytes, shared by the nodes of one host,
below each node's host tier. What the host tier drops is written here; a match continues here
past what the device and host hold; a node started on the host (a replacement, a scale-up)
finds what its predecessors wrote and announces it.

A chunk holds the KV of ``chunk_tokens`` consecutive tokens of a path, starting at a multiple
of ``chunk_tokens`` from the path's root; it is keyed by everything its KV depends on:

    key = sha256(model key | namespace | the path's tokens up to the chunk's end)

The model key (``model_key``) covers the contents of the checkpoint's weights (``pd.model.
loader.weights_digest``), the weight format, the KV dtype and the page size, so a file of
another model, format or tenant never matches. The directory (``pd.cache.disk_dir``) is this
user's, 0700, bounded as a whole across the nodes that share it, and holds the key that
authenticates every chunk's header. Chunks are written by one writer thread per node
(``pd.cache.disk_writer``: the engine's step only copies the KV out and queues it; a chunk
still queued counts as held, and a full queue skips the chunk), each to a temporary name and
then renamed (atomic on one file system).

A chunk file's format and the checks a read makes are ``pd.cache.chunk_file``'s. A file failing
any check is counted, removed and never loaded (a node's start-up scan checks all but the
payload).

A match (``match``) only asks the file system which chunks exist (a ``stat`` each): the caller
decides from that whether loading pays before any byte is read (``read_chunks``).

Failures. Every file-system error is contained here. A chunk is written only if the file
system keeps its floor after it (``DiskDir.room_for``: the oldest chunks make way when they
can); when it cannot, or the disk is full anyway (ENOSPC, EDQUOT: another writer won the
race), writes are held back (``disk_writer.HoldBack``: skipped unqueued and counted, then checked again
after a period doubling to a minute), never retried chunk by chunk against a full disk. Any
other error (a read-only or vanished directory, EIO, EACCES) turns the tier off, logged once
and reported (``DiskStats.is_off``): from then on it holds, finds and writes nothing, and the
node serves on without it (a restart tries again). An insecure directory or parent is refused
at start (``InsecurePathError``): that is the operator's to fix.

The payload's bytes are the mover's (``BaseKVMover.host_bytes`` and ``device_bytes``); this
module never looks inside them.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from pd.cache.chunk_file import (
    chain_key,
    chain_keys,
    read_header,
    read_payload,
)
from pd.cache.disk_dir import (
    CHUNK_SUFFIX,
    DiskDir,
    exists,
    touch,
    unlink_if_there,
)
from pd.cache.disk_writer import ChunkWriter, WriteCounts
from pd.core.private_dir import InsecurePathError

logger = logging.getLogger(__name__)


class DiskStats(NamedTuple):
    num_bytes: int  # what the directory holds now, every node's chunks (as last counted)
    max_bytes: int
    num_hit_tokens: int  # prompt tokens loaded from here
    num_loads: int  # chunks loaded
    num_load_bytes: int
    load_seconds: float
    num_written: int  # chunks written
    num_write_skipped: int  # chunks not written: the writer queue was full
    num_write_failed: int  # chunks the disk refused (full) or larger than max_bytes
    num_write_held: int  # chunks not written: the file system at its floor (HoldBack)
    num_rejected: int  # files found truncated, corrupt, unauthenticated or foreign, and removed
    num_evicted: int  # files removed for room (by this node)
    is_off: bool  # turned off by a file-system error (logged); the node serves without it


class ChunkRef(NamedTuple):
    """A chunk of the matched tokens that exists (as a match found it), not yet read."""

    start: int  # where the chunk begins in the path
    end: int


class Chunk(NamedTuple):
    path: list[int]  # the path's tokens from its root to the chunk's end
    start: int  # where the chunk begins in the path
    payload: memoryview  # a writable view of the file's bytes

    @property
    def end(self) -> int:
        return len(self.path)


class DiskTier:
    """Chunks of ``chunk_tokens`` in ``root/<key>/``; ``root`` holds at most ``max_bytes``, and
    is written only while its file system keeps ``min_free_bytes`` and ``min_free_fraction``
    of itself free."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        key: str,
        chunk_tokens: int,
        max_bytes: int,
        min_free_bytes: int = 0,
        min_free_fraction: float = 0.0,
    ):
        if chunk_tokens < 1 or max_bytes < 1:
            raise ValueError(
                f"chunk_tokens and max_bytes must be >= 1: {chunk_tokens}, {max_bytes}"
            )
        self.key = key
        self.chunk_tokens = chunk_tokens
        self.max_bytes = max_bytes
        self.dir = Path(root) / key
        self._num_hit = self._num_loads = self._num_load_bytes = 0
        self._num_rejected = 0
        self._load_seconds = 0.0
        self.off_reason: str | None = None
        self._lock = threading.Lock()
        self._store: DiskDir | None = None
        self._writer: ChunkWriter | None = None
        with self._contained("opening"):  # an insecure directory is raised, not contained
            self._store = DiskDir(Path(root), max_bytes, min_free_bytes, min_free_fraction)
            self.dir = self._store.subdir(key)
            self._writer = ChunkWriter(self._store, key, self.dir, self._turn_off)

    @property
    def is_on(self) -> bool:
        return self.off_reason is None

    @contextmanager
    def _contained(self, doing: str) -> Iterator[None]:
        """Turn the tier off on a file-system error in the block (logged once), instead of
        raising it into the caller's step."""
        try:
            yield
        except InsecurePathError:
            raise
        except OSError as e:
            self._turn_off(f"{doing} failed: {e}")

    def _turn_off(self, reason: str) -> None:
        if self.off_reason is None:
            self.off_reason = reason
            logger.error(
                "disk tier %s is off: %s; the node serves on without it (restart it to try "
                "the directory again)", self.dir, reason,
            )  # fmt: skip

    # -- writing --------------------------------------------------------------------------------

    def missing(self, namespace: str, tokens: Sequence[int], first: int) -> list[int]:
        """Ends of the whole chunks of ``tokens``, from the one ending at ``first`` on, that
        are neither here nor queued to be written (none while the tier is off)."""
        ends: list[int] = []
        if not self.is_on:
            return ends
        with self._contained("looking up chunks"):
            for end, name in chain_keys(self.key, namespace, tokens, first, self.chunk_tokens):
                file = self.dir / (name + CHUNK_SUFFIX)
                queued = self._writer is not None and self._writer.is_queued(file)
                if not queued and not exists(file):
                    ends.append(end)
        return ends if self.is_on else []

    def write(self, namespace: str, path: Sequence[int], payload: bytes) -> None:
        """Queue the chunk that ends at ``len(path)`` for the writer thread (started on first
        use), which writes it atomically, evicting for room; the caller's step does not wait
        for the disk. With ``disk_writer.MAX_PENDING_WRITES`` queued, or while writes are held
        back, the chunk is skipped (counted): a cache may lose what it cannot keep."""
        assert len(path) % self.chunk_tokens == 0, (len(path), self.chunk_tokens)
        if not self.is_on:
            return
        target = self._file(namespace, path)
        with self._contained("refreshing a chunk"):
            if touch(target):  # here already: recently used, evicted last
                return
        if self._writer is not None and self.is_on:
            self._writer.submit(target, namespace, list(path), payload)

    def flush(self) -> None:
        """Wait until every queued chunk is written (or failed)."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Write what is queued, then stop the writer thread."""
        if self._writer is not None:
            self._writer.close()
        if self._store is not None:
            self._store.close()
            self._store = None

    # -- reading --------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], namespace: str, start: int) -> list[ChunkRef]:
        """The chunks that continue ``tokens`` from the chunk holding position ``start``, in
        order, as far as the directory has them (by name: nothing is read)."""
        c = self.chunk_tokens
        refs: list[ChunkRef] = []
        if not self.is_on:
            return refs
        first = (start // c + 1) * c
        with self._contained("looking up chunks"):
            for end, name in chain_keys(self.key, namespace, tokens, first, c):
                if not exists(self.dir / (name + CHUNK_SUFFIX)):
                    break
                refs.append(ChunkRef(end - c, end))
        return refs if self.is_on else []

    def read_chunks(
        self, tokens: Sequence[int], refs: Sequence[ChunkRef], namespace: str
    ) -> list[Chunk]:
        """The chunks of ``tokens`` at ``refs``, read and checked, as far as they are whole and
        intact."""
        chunks: list[Chunk] = []
        for ref in refs:
            chunk = self.read(namespace, tokens[: ref.end])
            if chunk is None:
                break
            chunks.append(chunk)
        return chunks

    def read(self, namespace: str, path: Sequence[int]) -> Chunk | None:
        """The chunk ending at ``len(path)``, checked; None if absent or rejected (removed), or
        if the tier is off."""
        if not self.is_on:
            return None
        file = self._file(namespace, path)
        with self._contained("reading a chunk"):
            payload = self._read_payload(file, namespace, path)
            if payload is None:
                return None
            touch(file)  # recently used: evicted last
            return Chunk(list(path), len(path) - self.chunk_tokens, payload)
        return None

    def _read_payload(self, file: Path, namespace: str, path: Sequence[int]) -> memoryview | None:
        assert self._store is not None
        try:
            with open(file, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                header = read_header(f, size, self._store.tag)
                data = None
                if header is not None and header.names(self.key, namespace, path):
                    data = read_payload(f, header)
                if data is None:
                    self._reject(file)
                    return None
        except FileNotFoundError:  # not written, or evicted by another node meanwhile
            return None
        return memoryview(data)

    def _reject(self, file: Path) -> None:
        unlink_if_there(file)  # the directory's count stays high until a write recounts it
        with self._lock:
            self._num_rejected += 1

    def note_load(self, num_chunks: int, num_tokens: int, num_bytes: int, seconds: float) -> None:
        self._num_hit += num_tokens
        self._num_loads += num_chunks
        self._num_load_bytes += num_bytes
        self._load_seconds += seconds

    # -- what the directory holds, for a node that starts --------------------------------------

    def scan(self) -> list[tuple[str, list[int]]]:
        """(namespace, path) of the longest whole chains the directory holds (every chunk of
        the path from its root is here, with an intact header), most recently used first;
        rejected files are removed on the way."""
        found: dict[tuple[str, tuple[int, ...]], float] = {}
        if not self.is_on:
            return []
        with self._contained("scanning"):
            for file in self.dir.glob("*" + CHUNK_SUFFIX):
                entry = self._scan_one(file)
                if entry is not None:
                    found[(entry[0], tuple(entry[1]))] = entry[2]
        if not self.is_on:
            return []
        c = self.chunk_tokens
        parents = {(namespace, tokens[:-c]) for namespace, tokens in found}
        chains = [
            (used, namespace, list(tokens))
            for (namespace, tokens), used in found.items()
            if (namespace, tokens) not in parents
            and all((namespace, tokens[:end]) in found for end in range(c, len(tokens), c))
        ]
        chains.sort(key=lambda chain: -chain[0])
        return [(namespace, path) for _, namespace, path in chains]

    def _scan_one(self, file: Path) -> tuple[str, list[int], float] | None:
        """(namespace, path, last use) of the chunk file ``file`` by its header, or None (a
        bad one is rejected)."""
        assert self._store is not None
        try:  # the header only: a payload is checked when it is read
            with open(file, "rb") as f:
                st = os.fstat(f.fileno())
                header = read_header(f, st.st_size, self._store.tag)
        except FileNotFoundError:
            return None
        if (
            header is None
            or header.model_key != self.key
            or len(header.tokens) % self.chunk_tokens
            or not header.tokens
            or self._file(header.namespace, header.tokens) != file
        ):
            self._reject(file)
            return None
        return header.namespace, header.tokens, st.st_mtime

    @property
    def stats(self) -> DiskStats:
        num_bytes = 0
        if self._store is not None and self.is_on:
            with self._contained("counting the directory"):
                num_bytes = self._store.num_bytes
        w = self._writer.counts if self._writer is not None else WriteCounts()
        return DiskStats(
            num_bytes=num_bytes,
            max_bytes=self.max_bytes,
            num_hit_tokens=self._num_hit,
            num_loads=self._num_loads,
            num_load_bytes=self._num_load_bytes,
            load_seconds=self._load_seconds,
            num_written=w.written,
            num_write_skipped=w.skipped,
            num_write_failed=w.failed,
            num_write_held=w.held,
            num_rejected=self._num_rejected,
            num_evicted=0 if self._store is None else self._store.num_evicted,
            is_off=not self.is_on,
        )

    def _file(self, namespace: str, tokens: Sequence[int]) -> Path:
        return self.dir / (chain_key(self.key, namespace, tokens) + CHUNK_SUFFIX)
