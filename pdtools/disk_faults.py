"""A disk tier's directory harmed from outside, as ``tests/cache/test_disk_tier.py`` and the
chaos soak (``pdtools.chaos_hardening``) harm it: made read-only (a file system gone read-only)
and a chunk planted by someone who can write the directory but does not hold its key.

Root, whom modes do not stop, is stopped by ``chattr +i`` (ext4, xfs, btrfs): an immutable
directory takes no new file, rename or removal, and an immutable file no write and no
``utime``; a user is stopped by ``chmod``.
"""

from __future__ import annotations

import os
import random
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import msgspec

from pd.cache.chunk_file import MAGIC, ChunkHeaderMsg, chain_key
from pd.cache.disk_dir import CHUNK_SUFFIX
from pd.cache.disk_tier import DiskTier


class CannotHarm(RuntimeError):
    """This process cannot make the harm here (root without a working ``chattr``)."""


def make_read_only(d: Path) -> Callable[[], None]:
    """Make the directory ``d`` and its files unwritable for every process of this user (and
    root's): ``chmod`` as a user, ``chattr +i`` as root. Returns the undo (which makes what was
    changed writable again, the directory first: nothing is left immutable)."""
    paths = [str(d), *(str(p) for p in d.iterdir())]
    if os.geteuid() != 0:
        for p in paths:
            os.chmod(p, 0o500 if os.path.isdir(p) else 0o400)
        return lambda: [os.chmod(p, 0o700 if os.path.isdir(p) else 0o600) for p in paths]
    if shutil.which("chattr") is None:
        raise CannotHarm("root, and no chattr: no way to make a directory read-only")
    # the directory first: no file appears unprotected after the listing
    done = subprocess.run(["chattr", "+i", *paths], capture_output=True, text=True)
    if done.returncode:
        subprocess.run(["chattr", "-i", *paths], capture_output=True)
        raise CannotHarm(f"chattr +i {d}: {done.stderr.strip()[:200]}")
    return lambda: subprocess.run(["chattr", "-i", *paths], check=True, capture_output=True)


def writable_again(d: Path) -> None:
    """Undo any ``make_read_only`` under ``d`` that was not undone (a soak cut short), so that
    ``d`` can be removed: ``chattr -R -i`` as root (errors ignored)."""
    if os.geteuid() == 0 and shutil.which("chattr") is not None:
        subprocess.run(["chattr", "-R", "-i", str(d)], capture_output=True)


def forged_chunk(
    model_key: str, namespace: str, tokens: list[int], payload: bytes, scratch: Path
) -> tuple[str, bytes]:
    """(file name, bytes) of a chunk of ``tokens`` whose payload is ``payload`` and whose
    header carries that payload's right sha256, as pd writes it, but authenticated under a key
    of its own (``scratch``'s, made there): what a planter without the directory's key makes."""
    tier = DiskTier(scratch, model_key, len(tokens), 2**40)
    try:
        tier.write(namespace, tokens, payload)
        tier.flush()
    finally:
        tier.close()
    name = chain_key(model_key, namespace, tokens) + CHUNK_SUFFIX
    return name, (scratch / model_key / name).read_bytes()


def read_header(file: Path) -> ChunkHeaderMsg:
    """A chunk file's header, unauthenticated (a planter reads what it overwrites)."""
    with open(file, "rb") as f:
        head = f.read(len(MAGIC) + 4)
        if not head.startswith(MAGIC):
            raise ValueError(f"{file} is not a chunk file")
        (n,) = struct.unpack_from("<I", head, len(MAGIC))
        return msgspec.msgpack.decode(f.read(n), type=ChunkHeaderMsg)


def plant_over(file: Path, seed: int) -> bytes:
    """Replace the chunk ``file`` (atomically, as pd writes) with a forgery of the same name,
    key, namespace and tokens: a random payload of its length, with its right sha256, signed
    under another key. Returns the forged bytes (to tell it from a chunk written later)."""
    header = read_header(file)
    payload = random.Random(seed).randbytes(header.payload_bytes)  # not the KV: any bytes
    with tempfile.TemporaryDirectory(prefix="pd-planter-") as scratch:
        name, data = forged_chunk(
            header.model_key, header.namespace, header.tokens, payload, Path(scratch)
        )
    assert name == file.name, (name, file.name)  # the name pd looks the chunk up by
    tmp = file.with_name(f".plant-{seed}{CHUNK_SUFFIX}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, file)
    return data
