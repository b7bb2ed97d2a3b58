"""Compiled decode steps kept on disk, so that a node started again on a machine that has run it
loads its steps in seconds instead of compiling them (``pd.executor.graphs``).

1. The key. An entry is a directory ``PD_CACHE_DIR/compiled/<key>/``, the key a sha256 over all
   that shapes a step's code: pd's own source (every ``.py`` and ``.cpp`` of the package), torch's
   and Python's versions, the CPU's flags and ``PD_CPU_ISA``, torch's thread count, and what the
   caller names (``identity``: the weights' digest, the model's modules, the flags, the pool's
   shapes). Anything else is another entry; nothing is looked up by a part of a key.
2. An entry holds a file per bucket, ``step-<bucket>.bin`` (torch's serialized precompiled
   function: ``torch.compile(...).aot_compile``). ``compiled/inductor/`` is torch's inductor cache
   while any entry's steps compile and load: a C++ kernel is built once on a machine, whichever
   model, pool or flags first needed it (inductor keys its kernels by their source). A file is
   written aside and renamed in (``os.replace``): nodes of one machine writing the same entry
   leave one whole file.
3. A file carries the sha256 of its payload, checked before it is unpickled. A file that fails the
   check, does not deserialize or whose step does not run is logged, removed and compiled again:
   a bad entry costs a compile, never a wrong answer or a crash. What is unpickled is code, so
   ``compiled/`` is made 0700 and every file must be this user's and writable by no one else
   (``pd.core.private_dir``), as ``pd.core.cpp``'s kernels are.
4. Bounded: past ``MAX_ENTRIES`` entries the least recently used (by mtime, touched when used)
   are removed when a new one is made, and ``inductor/`` is emptied when it holds more than
   ``MAX_INDUCTOR_BYTES`` (a step loaded afterwards builds its kernels again). An entry removed
   while another process compiles into it costs that process its compile (the bucket stays
   eager, logged), never an answer.
5. Not kept (``ModelRunner._step_cache``): steps that freeze their weights
   (``--no-deterministic``), a mixture of experts' and a tensor-parallel rank's (its step's
   guards hold its process group): torch cannot save them, so they compile at each start.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from pd.core import cpp
from pd.core.private_dir import InsecurePathError, check_parents, check_trusted, private_dir

logger = logging.getLogger(__name__)

MAX_ENTRIES = 8  # entries (one per model x flags x code) kept under PD_CACHE_DIR/compiled
MAX_INDUCTOR_BYTES = 1 << 30  # the kernels' directory, emptied when a new entry finds it larger
INDUCTOR = "inductor"  # compiled/inductor: torch's inductor cache, shared by the entries
_MAGIC = b"pd-compiled-step-1\n"


@functools.cache
def source_digest() -> str:
    """sha256 over pd's source files (``.py`` and ``.cpp``), by path: another version of pd
    is another key."""
    root = Path(__file__).resolve().parents[1]  # the pd package
    digest = hashlib.sha256()
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.cpp")]):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def entry_key(identity: Mapping[str, str]) -> str:
    """The key of the entry for a caller's ``identity`` on this machine and version of pd."""
    parts = {
        "pd": source_digest(),
        "torch": torch.__version__,
        "python": sys.version,
        "cpu": cpp.cpu_signature(),
        "threads": str(torch.get_num_threads()),
        **identity,
    }
    text = "\0".join(f"{k}={v}" for k, v in sorted(parts.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class CompiledStepCache:
    """One entry of compiled steps (``identity``: what the caller's steps depend on)."""

    def __init__(self, identity: Mapping[str, str], root: Path) -> None:
        self.root = root
        self.key = entry_key(identity)
        self.num_loaded = 0  # steps read from disk by this object
        self.num_saved = 0  # steps written
        self.num_rejected = 0  # files found bad and removed

    @property
    def entry_dir(self) -> Path:
        return self.root / self.key

    def _path(self, bucket: int) -> Path:
        return self.entry_dir / f"step-{bucket}.bin"

    def _ensure(self) -> Path:
        """The entry's directory (and ``compiled/``), made 0700 and checked; touched (LRU)."""
        check_parents(self.root)  # else compiled/ could be swapped
        private_dir(self.root)
        entry = private_dir(self.entry_dir)
        os.utime(entry)
        return entry

    @contextmanager
    def inductor_dir(self) -> Iterator[None]:
        """torch's inductor cache pointed at ``compiled/inductor/`` meanwhile (what a step
        compiles or loads finds its C++ kernels there, whichever entry built them)."""
        # (imported here: torch._inductor brings torch._dynamo, a second of every process's
        # start, which a node that compiles nothing never needs)
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        self._ensure()
        inductor = private_dir(self.root / INDUCTOR)
        with temporary_cache_dir(str(inductor)):
            yield

    def load(self, bucket: int) -> Any | None:
        """The step of ``bucket`` read from disk (torch's ``AOTCompiledFunction``), or None:
        none yet, or a bad file (logged and removed). Call inside ``inductor_dir()``."""
        path = self._path(bucket)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        check_trusted(path, st, is_dir=False)
        try:
            data = path.read_bytes()
            payload = _unwrap(data)
            from torch._dynamo.aot_compile import AOTCompiledFunction

            step = AOTCompiledFunction.deserialize(payload)
        except InsecurePathError:
            raise
        except Exception as e:  # a corrupt or foreign file: compiled again
            self.reject(bucket, f"{type(e).__name__}: {e}")
            return None
        self.num_loaded += 1
        return step

    def save(self, bucket: int, step: Any) -> None:
        """Write ``step`` (an ``AOTCompiledFunction``) as ``bucket``'s file; a step torch cannot
        serialize is logged and left in memory only."""
        try:
            from torch._dynamo.aot_compile import AOTCompiledFunction

            payload = AOTCompiledFunction.serialize(step).serialized_data
            entry = self._ensure()
            fd, tmp = tempfile.mkstemp(dir=entry, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(_wrap(payload))
                os.replace(tmp, self._path(bucket))  # whole or absent, whoever writes it
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except InsecurePathError:
            raise
        except Exception as e:
            logger.warning("keeping the compiled step of bucket %d failed (%s)", bucket, e)
            return
        self.num_saved += 1
        prune(self.root, keep=self.key)

    def reject(self, bucket: int, why: str) -> None:
        """Remove ``bucket``'s file, found bad (``why``): the next start compiles it again."""
        logger.warning("compiled step %s of bucket %d is unusable (%s): compiling it",
                       self._path(bucket), bucket, why)  # fmt: skip
        self.num_rejected += 1
        self._path(bucket).unlink(missing_ok=True)


def _wrap(payload: bytes) -> bytes:
    return _MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def _unwrap(data: bytes) -> bytes:
    """The payload of a file, or ValueError where it is not one whole file of this format."""
    head = len(_MAGIC) + 65
    if len(data) < head or not data.startswith(_MAGIC):
        raise ValueError("not a compiled step of this format")
    digest, payload = data[len(_MAGIC) : head - 1], data[head:]
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise ValueError("its sha256 does not match its contents (truncated or altered)")
    return payload


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed meanwhile by another process's prune
        return 0.0


def prune(
    root: Path,
    keep: str,
    max_entries: int = MAX_ENTRIES,
    max_inductor_bytes: int = MAX_INDUCTOR_BYTES,
) -> list[Path]:
    """Remove the least recently used entries under ``root`` past ``max_entries`` (never
    ``keep``), and the shared kernels' directory if it holds more than ``max_inductor_bytes``;
    -> those removed."""
    try:
        entries = [p for p in root.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        return []
    entries = [p for p in entries if p.name != INDUCTOR]
    entries.sort(key=_mtime, reverse=True)
    removed = []
    for entry in entries[max_entries:]:
        if entry.name != keep:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    kernels = root / INDUCTOR
    if _size(kernels) > max_inductor_bytes:
        shutil.rmtree(kernels, ignore_errors=True)  # a step loaded later builds its own again
        removed.append(kernels)
    return removed


def _size(path: Path) -> int:
    """Bytes of the files under ``path`` (0 where it is absent)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:  # removed meanwhile
                pass
    return total
