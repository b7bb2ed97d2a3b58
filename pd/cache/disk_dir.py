"""The disk tier's directory, shared by the nodes of one host: who may write it, the key that
authenticates its chunks, and its bound in bytes across every node that writes it.

Layout::

    root/                  0700 (pd.core.private_dir: another user's, or group- or
      .pd-key              other-writable, is refused)
                           32 random bytes, 0600: the HMAC key of every chunk's header
      .pd-usage            8 bytes, little endian: what the chunks in root/*/ hold, in bytes
      <model key>/         0700: one model's chunks (pd.cache.disk_tier)

The key. The threat is another user of the machine writing into the directory: a chunk is
what a request's answer is computed from. The directory's mode keeps such a user out; the key
is a second wall for when the mode does not (a mode changed later, a file system that ignores
it): a file written without the key is rejected unread. It lives in the directory, 0600, made
by the first node that finds none (written aside, then linked into place: one key wins), so the
chunks outlive a restart of ``pd serve`` and a colocated engine has one too. The cluster's
secret (``TransferConfig.secret``) is not used: it is made afresh by every ``pd serve``, which
would throw away the directory each restart, and a colocated engine has none. Not defended
against: this same user (it can read the key, as it can read the process), and root.

The bound. Every node that writes takes an exclusive ``flock`` on ``.pd-usage`` (and a thread
lock: flock is per open file, shared by the node's threads), reads the count and, if the chunk
fits under ``max_bytes``, adds it and renames the chunk in. If it does not fit, it scans
``root/*/*.kv`` (the truth: every model's chunks count), removes the oldest (by modification
time, which a read refreshes) until it fits, and writes the true count. A node that starts
recounts. A file removed outside the lock (a chunk rejected on read, a node killed between
counting and renaming) leaves the count high, never low, so the directory stays within
``max_bytes``; the next write that finds it full recounts.

The file system's floor. ``max_bytes`` bounds the chunks, not what else fills the file system:
before a chunk is written, ``room_for`` asks the file system (``statvfs``) whether it leaves
``floor`` bytes free (``min_free_bytes`` or ``min_free_fraction`` of the file system, the
larger) after the chunk. If not, the oldest chunks are removed when that restores the floor,
else nothing is removed or written (the directory's chunks stay readable): the caller holds
back (``pd.cache.disk_tier``), and a full disk is never written into.

The parents. Every directory above ``root`` is checked at start (``pd.core.private_dir.
check_parents``): one another user could write is refused, naming it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import logging
import os
import secrets
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pd.core.private_dir import InsecurePathError, check_parents, check_trusted, private_dir

KEY_FILE = ".pd-key"
USAGE_FILE = ".pd-usage"
KEY_BYTES = 32
CHUNK_SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"
STALE_TMP_SECONDS = 3600.0  # a temporary file this old was left by a writer that died
logger = logging.getLogger(__name__)


class DiskDir:
    """The directory ``root`` of at most ``max_bytes`` of chunks, in subdirectories."""

    def __init__(
        self, root: Path, max_bytes: int, min_free_bytes: int = 0, min_free_fraction: float = 0.0
    ) -> None:
        check_parents(root)  # before anything is made under them
        self.root = private_dir(root)
        check_parents(root)  # and those just made
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes
        self.min_free_fraction = min_free_fraction
        self.key = _load_key(self.root / KEY_FILE)
        self._usage_fd = _open_private(self.root / USAGE_FILE, os.O_RDWR | os.O_CREAT)
        self._thread_lock = threading.Lock()
        self.num_evicted = 0
        with self._locked():
            self._write_usage(self._scan(0))

    def subdir(self, name: str) -> Path:
        return private_dir(self.root / name)

    def tag(self, data: bytes | bytearray) -> bytes:
        """``data``'s HMAC-SHA256 under the directory's key."""
        return hmac.new(self.key, data, hashlib.sha256).digest()

    @property
    def num_bytes(self) -> int:
        """What the chunks hold, as last counted (by any node)."""
        return self._read_usage()

    def put(self, tmp: Path, target: Path, num_bytes: int) -> bool:
        """Rename the chunk file ``tmp`` (``num_bytes``) to ``target`` once the directory has
        room for it, evicting the oldest chunks of any model; False (``tmp`` left) if it
        cannot fit at all."""
        if num_bytes > self.max_bytes:
            return False
        with self._locked():
            held = self._read_usage()
            if held + num_bytes > self.max_bytes:
                held = self._scan(num_bytes)
            self._write_usage(held + num_bytes)  # before the rename: high, never low
            os.replace(tmp, target)
        return True

    def room_for(self, num_bytes: int) -> bool:
        """Whether the file system keeps its floor with ``num_bytes`` more written, after
        removing the oldest chunks (of any model) if that is enough to keep it; if it is not,
        nothing is removed."""
        short = num_bytes - self._free_above_floor()
        if short <= 0:
            return True
        with self._locked():
            held = self._scan(0)
            if held < short:  # others fill the file system: what is here stays
                return False
            self._write_usage(self._scan(0, bound=held - short))
        return num_bytes <= self._free_above_floor()

    def _free_above_floor(self) -> int:
        st = os.statvfs(self.root)
        floor = max(self.min_free_bytes, int(self.min_free_fraction * st.f_blocks * st.f_frsize))
        return st.f_bavail * st.f_frsize - floor

    def close(self) -> None:
        os.close(self._usage_fd)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock:
            fcntl.flock(self._usage_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._usage_fd, fcntl.LOCK_UN)

    def _read_usage(self) -> int:
        data = os.pread(self._usage_fd, 8, 0)
        return struct.unpack("<Q", data)[0] if len(data) == 8 else 0

    def _write_usage(self, num_bytes: int) -> None:
        os.pwrite(self._usage_fd, struct.pack("<Q", max(0, num_bytes)), 0)

    def _scan(self, room: int, bound: int | None = None) -> int:
        """Count the chunks of every subdirectory, removing the oldest until ``room`` more
        bytes fit within ``bound`` (default ``max_bytes``) and the temporary files of writers
        that died; -> the bytes left."""
        bound = self.max_bytes if bound is None else bound
        files: list[tuple[float, int, Path]] = []
        now = time.time()
        for sub in _entries(self.root):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for e in _entries(Path(sub.path)):
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if e.name.startswith(TMP_PREFIX):
                    if now - st.st_mtime > STALE_TMP_SECONDS:
                        unlink_if_there(Path(e.path))
                elif e.name.endswith(CHUNK_SUFFIX):
                    files.append((st.st_mtime, st.st_size, Path(e.path)))
        files.sort()
        held = sum(size for _, size, _ in files)
        for _, size, path in files:
            if held + room <= bound:
                break
            held -= size
            if unlink_if_there(path):
                self.num_evicted += 1
        return held


def _entries(path: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def unlink_if_there(p: Path) -> bool:
    """Remove ``p``; False if it was already gone (another node removed it first)."""
    try:
        p.unlink()
        return True
    except FileNotFoundError:
        return False


def exists(p: Path) -> bool:
    """``p`` exists (an error other than its absence is raised, unlike ``Path.exists``)."""
    try:
        os.stat(p)
        return True
    except FileNotFoundError:
        return False


def touch(p: Path) -> bool:
    """Refresh ``p``'s modification time (its last use); False if it is not there."""
    try:
        os.utime(p)
        return True
    except FileNotFoundError:
        return False


def _open_private(path: Path, flags: int) -> int:
    """An fd of the regular file ``path`` (created 0600), checked to be this user's and
    neither readable nor writable by group or others (``InsecurePathError``)."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        st = os.fstat(fd)
        check_trusted(path, st, is_dir=False)
        if st.st_mode & 0o077:
            raise InsecurePathError(
                f"{path} (mode {st.st_mode & 0o7777:04o}) is open to group or others: "
                f"refused; chmod 600 {path}"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _load_key(path: Path) -> bytes:
    """The directory's key, made if there is none (``KEY_BYTES`` random bytes, 0600)."""
    if not os.path.lexists(path):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TMP_PREFIX)  # 0600
        try:
            os.write(fd, secrets.token_bytes(KEY_BYTES))
            os.fsync(fd)
            os.close(fd)
            try:
                os.link(tmp, path)  # atomic, and never over a key another node made first
            except FileExistsError:
                pass
        finally:
            unlink_if_there(Path(tmp))
    fd = _open_private(path, os.O_RDONLY)
    try:
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise OSError(errno.EINVAL, f"{path} holds {len(key)} bytes, not a {KEY_BYTES}-byte key")
    return key
