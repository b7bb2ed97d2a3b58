"""The disk tier: KV chunks in a directory, bounded in bytes, shared by the nodes of one host,
below each node's host tier. What the host tier drops is written here; a match continues here
past what the device and host hold; a node started on the host (a replacement, a scale-up)
finds what its predecessors wrote and announces it.

A chunk holds the KV of ``chunk_tokens`` consecutive tokens of a path, starting at a multiple
of ``chunk_tokens`` from the path's root; it is keyed by everything its KV depends on:

    key = sha256(model key | namespace | the path's tokens up to the chunk's end)

The model key (``model_key``) covers the checkpoint, the weight format, the KV dtype and the
page size, so a file of another model, format or tenant never matches. Chunks are written by
one writer thread per node (the engine's step only copies the KV out and queues it; a chunk still
queued counts as held, and a full queue skips the chunk), each to a temporary name and then
renamed (atomic on one file system); its header repeats the key's parts and
a sha256 of the payload, checked on every read (a node's start-up scan reads headers only): a
truncated, corrupt or foreign file is counted, removed and never loaded. Files are evicted oldest first (by modification time, which a read
refreshes) when the directory passes its byte budget; a file another node removed meanwhile is a
miss.

File layout::

    b"PDKV1\\n" | header length (4 bytes, little endian) | header (JSON) | payload

The payload's bytes are the mover's (``BaseKVMover.host_bytes`` and ``device_bytes``); this module never looks
inside them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

MAGIC = b"PDKV1\n"
_SUFFIX = ".kv"
MAX_PENDING_WRITES = 64  # chunks queued for the writer thread; more are skipped
logger = logging.getLogger(__name__)


class DiskStats(NamedTuple):
    num_bytes: int  # what the directory holds now (as this node last counted)
    max_bytes: int
    num_hit_tokens: int  # prompt tokens loaded from here
    num_loads: int  # chunks loaded
    num_load_bytes: int
    load_seconds: float
    num_written: int  # chunks written
    num_write_skipped: int  # chunks not written: the writer was MAX_PENDING_WRITES behind
    num_write_failed: int  # chunks the disk refused (full, failing)
    num_rejected: int  # files found truncated, corrupt or foreign, and removed
    num_evicted: int  # files removed for room


class Chunk(NamedTuple):
    path: list[int]  # the path's tokens from its root to the chunk's end
    start: int  # where the chunk begins in the path
    payload: memoryview  # a writable view of the file's bytes

    @property
    def end(self) -> int:
        return len(self.path)


def model_key(*parts: object) -> str:
    """A short digest of what a chunk's KV depends on besides its tokens (model files, weight
    format, KV dtype, page size, chunk size)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def chain_key(key: str, namespace: str, tokens: Sequence[int]) -> str:
    h = hashlib.sha256(f"{key}|{namespace}|".encode())
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    return h.hexdigest()[:40]


class DiskTier:
    """Chunks of ``chunk_tokens`` in ``root/<key>/``, at most ``max_bytes`` of them."""

    def __init__(self, root: str | os.PathLike[str], key: str, chunk_tokens: int, max_bytes: int):
        if chunk_tokens < 1 or max_bytes < 1:
            raise ValueError(
                f"chunk_tokens and max_bytes must be >= 1: {chunk_tokens}, {max_bytes}"
            )
        self.key = key
        self.chunk_tokens = chunk_tokens
        self.max_bytes = max_bytes
        self.dir = Path(root) / key
        self.dir.mkdir(parents=True, exist_ok=True)
        self._num_bytes = sum(_size(p) for p in self.dir.glob("*" + _SUFFIX))
        self._num_hit = self._num_loads = self._num_load_bytes = 0
        self._num_written = self._num_rejected = self._num_evicted = 0
        self._num_write_skipped = self._num_write_failed = 0
        self._load_seconds = 0.0
        # chunks queued for the writer thread: file -> (namespace, path, payload)
        self._lock = threading.Lock()
        self._pending: dict[Path, tuple[str, list[int], bytes]] = {}
        self._queue: queue.Queue[Path | None] = queue.Queue()
        self._writer: threading.Thread | None = None

    # -- writing --------------------------------------------------------------------------------

    def chunk_ends(self, path_len: int, dropped_from: int) -> range:
        """Ends of the whole chunks of a path of ``path_len`` tokens that hold a token at or
        after ``dropped_from`` (the chunks to write when those tokens leave the host)."""
        c = self.chunk_tokens
        first = (dropped_from // c + 1) * c
        return range(first, path_len - path_len % c + 1, c)

    def has(self, namespace: str, tokens: Sequence[int]) -> bool:
        """The chunk ending at ``len(tokens)`` is here, or queued to be written."""
        file = self._file(namespace, tokens)
        with self._lock:
            if file in self._pending:
                return True
        return file.exists()

    def write(self, namespace: str, path: Sequence[int], payload: bytes) -> None:
        """Queue the chunk that ends at ``len(path)`` for the writer thread (started on first
        use), which writes it atomically, evicting for room; the caller's step does not wait
        for the disk. With ``MAX_PENDING_WRITES`` queued already, the chunk is skipped
        (counted): a cache may lose what it cannot keep up with."""
        assert len(path) % self.chunk_tokens == 0, (len(path), self.chunk_tokens)
        target = self._file(namespace, path)
        if target.exists():
            os.utime(target)
            return
        with self._lock:
            if target in self._pending:
                return
            if len(self._pending) >= MAX_PENDING_WRITES:
                self._num_write_skipped += 1
                return
            self._pending[target] = (namespace, list(path), payload)
        if self._writer is None:
            self._writer = threading.Thread(
                target=self._write_loop, name="pd-disk-tier", daemon=True
            )
            self._writer.start()
        self._queue.put(target)

    def flush(self) -> None:
        """Wait until every queued chunk is written (or failed)."""
        if self._writer is not None:
            self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer thread."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None

    def _write_loop(self) -> None:
        while True:
            target = self._queue.get()
            try:
                if target is None:
                    return
                with self._lock:
                    namespace, path, payload = self._pending[target]
                try:
                    self._write_now(target, namespace, path, payload)
                except OSError as e:  # a full or failing disk: the chunk is not kept
                    logger.warning("disk tier: writing %s failed: %s", target.name, e)
                    with self._lock:
                        self._num_write_failed += 1
                finally:
                    with self._lock:
                        del self._pending[target]
            finally:
                self._queue.task_done()

    def _write_now(self, target: Path, namespace: str, path: list[int], payload: bytes) -> None:
        header = json.dumps(
            {
                "key": self.key,
                "namespace": namespace,
                "tokens": path,
                "start": len(path) - self.chunk_tokens,
                "payload_bytes": len(payload),
                "sha256": hashlib.sha256(payload).hexdigest(),
            }
        ).encode()
        data = MAGIC + struct.pack("<I", len(header)) + header + payload
        self._make_room(len(data))
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
        except BaseException:
            _unlink(Path(tmp))
            raise
        with self._lock:
            self._num_bytes += len(data)
            self._num_written += 1

    def _make_room(self, num_bytes: int) -> None:
        if self._num_bytes + num_bytes <= self.max_bytes:
            return
        files = sorted(self.dir.glob("*" + _SUFFIX), key=_mtime)
        held = sum(_size(p) for p in files)  # other nodes write here too
        for p in files:
            if held + num_bytes <= self.max_bytes:
                break
            held -= _size(p)
            if _unlink(p):
                with self._lock:
                    self._num_evicted += 1
        with self._lock:
            self._num_bytes = held

    # -- reading --------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], namespace: str, start: int) -> list[Chunk]:
        """The chunks that continue ``tokens`` from the chunk holding position ``start``, in
        order, as far as the directory has them whole and intact."""
        c = self.chunk_tokens
        chunks: list[Chunk] = []
        for end in range((start // c + 1) * c, len(tokens) + 1, c):
            chunk = self.read(namespace, tokens[:end])
            if chunk is None:
                break
            chunks.append(chunk)
        return chunks

    def read(self, namespace: str, path: Sequence[int]) -> Chunk | None:
        """The chunk ending at ``len(path)``, checked; None if absent or rejected (removed)."""
        file = self._file(namespace, path)
        try:
            with open(file, "rb") as f:  # into one writable buffer: the payload is a view of it
                data = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(data)
        except FileNotFoundError:
            return None
        split = _split(data)
        if split is None or not self._is_of(split[0], namespace, path):
            self._reject(file, len(data))
            return None
        header, payload = split
        if header.get("sha256") != hashlib.sha256(payload).hexdigest():
            self._reject(file, len(data))
            return None
        os.utime(file)  # recently used: evicted last
        return Chunk(list(path), len(path) - self.chunk_tokens, payload)

    def _is_of(self, header: dict[str, object], namespace: str, path: Sequence[int]) -> bool:
        """``header`` names exactly this key, namespace and token path."""
        return (
            header.get("key") == self.key
            and header.get("namespace") == namespace
            and header.get("tokens") == list(path)
        )

    def _reject(self, file: Path, num_bytes: int) -> None:
        removed = _unlink(file)
        with self._lock:
            self._num_rejected += 1
            self._num_bytes -= num_bytes if removed else 0

    def note_load(self, num_chunks: int, num_tokens: int, num_bytes: int, seconds: float) -> None:
        self._num_hit += num_tokens
        self._num_loads += num_chunks
        self._num_load_bytes += num_bytes
        self._load_seconds += seconds

    # -- what the directory holds, for a node that starts --------------------------------------

    def scan(self) -> list[tuple[str, list[int]]]:
        """(namespace, path) of the longest whole chains the directory holds (every chunk of
        the path from its root is here and intact), most recently used first; rejected files
        are removed on the way."""
        found: dict[tuple[str, tuple[int, ...]], float] = {}
        for file in self.dir.glob("*" + _SUFFIX):
            try:  # the header only: a payload is checked when it is read
                with open(file, "rb") as f:
                    st = os.fstat(f.fileno())
                    size, used = st.st_size, st.st_mtime
                    head = f.read(len(MAGIC) + 4)
                    split = _split_header(head, f.read, size)
            except FileNotFoundError:
                continue
            namespace = split.get("namespace") if split else None
            tokens = split.get("tokens") if split else None
            if (
                not isinstance(namespace, str)
                or not isinstance(tokens, list)
                or self._file(namespace, tokens) != file
                or not self._is_of(split, namespace, tokens)  # type: ignore[arg-type]
            ):
                self._reject(file, size)
                continue
            found[(namespace, tuple(tokens))] = used
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

    @property
    def stats(self) -> DiskStats:
        return DiskStats(
            num_bytes=self._num_bytes,
            max_bytes=self.max_bytes,
            num_hit_tokens=self._num_hit,
            num_loads=self._num_loads,
            num_load_bytes=self._num_load_bytes,
            load_seconds=self._load_seconds,
            num_written=self._num_written,
            num_write_skipped=self._num_write_skipped,
            num_write_failed=self._num_write_failed,
            num_rejected=self._num_rejected,
            num_evicted=self._num_evicted,
        )

    def _file(self, namespace: str, tokens: Sequence[int]) -> Path:
        return self.dir / (chain_key(self.key, namespace, tokens) + _SUFFIX)


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except FileNotFoundError:
        return 0


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _unlink(p: Path) -> bool:
    try:
        p.unlink()
        return True
    except FileNotFoundError:
        return False


def _split(data: bytearray) -> tuple[dict[str, object], memoryview] | None:
    """A chunk file's header and a view of its payload, if it is shaped like one (magic,
    header, payload of the size the header says), else None. The checksum is the caller's."""
    n = len(MAGIC) + 4
    header = _split_header(data[:n], lambda k: data[n : n + k], len(data))
    if header is None:
        return None
    (header_len,) = struct.unpack_from("<I", data, len(MAGIC))
    return header, memoryview(data)[n + header_len :]


def _split_header(
    head: bytes | bytearray, read: Callable[[int], bytes | bytearray], size: int
) -> dict[str, object] | None:
    """The header of a chunk file of ``size`` bytes whose first bytes are ``head`` (the magic
    and the header's length); ``read(n)`` gives the next n bytes. None if the shape is wrong."""
    n = len(MAGIC)
    if len(head) < n + 4 or not head.startswith(MAGIC):
        return None
    (header_len,) = struct.unpack_from("<I", head, n)
    try:
        header = json.loads(read(header_len))
    except ValueError:
        return None
    if not isinstance(header, dict) or header.get("payload_bytes") != size - n - 4 - header_len:
        return None
    return header
