"""The disk tier's free-space floor and its directory's parents (issue 55, item 13): on a small
real file system (a 4 MiB tmpfs mounted for the test, as root; skipped otherwise), filled by
someone else to near or below the floor, the tier never writes the file system full, does not
retry chunk by chunk, keeps serving what it holds, and writes again once there is room; a
directory under a parent another user could write is refused at start, naming the parent."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pd.cache.disk_dir import DiskDir
from pd.cache.disk_tier import DiskTier
from pd.core.private_dir import InsecurePathError

pytestmark = pytest.mark.timeout(60)
CHUNK = 8
PAYLOAD = 64 * 1024
FLOOR = 1 << 20


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs of its own, unmounted at the end."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small file system needs root and mount(8)")
    mnt = tmp_path / "fs"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()[:200]}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _free(p: Path) -> int:
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def _fill_to(mnt: Path, free: int) -> Path:
    """Someone else's file that leaves ``free`` bytes of ``mnt`` free (to a page)."""
    filler = mnt / "someone-elses-file"
    with open(filler, "ab") as f:
        while _free(mnt) > free:
            f.write(b"x" * min(64 * 1024, _free(mnt) - free))
            f.flush()
    return filler


def _chunk(i: int) -> tuple[list[int], bytes]:
    return [i] * CHUNK, random.Random(i).randbytes(PAYLOAD)


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of chunk files begun (``tempfile.mkstemp``) and free-space checks (``statvfs``)."""
    calls = {"mkstemp": 0, "statvfs": 0}

    def wrap(name: str, f: Callable) -> Callable:
        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return f(*args, **kwargs)

        return counted

    monkeypatch.setattr(tempfile, "mkstemp", wrap("mkstemp", tempfile.mkstemp))
    monkeypatch.setattr(os, "statvfs", wrap("statvfs", os.statvfs))
    return calls


def _held_chunks_read_back(tier: DiskTier, ids: range) -> None:
    for i in ids:
        path, payload = _chunk(i)
        chunk = tier.read("", path)
        assert chunk is not None and bytes(chunk.payload) == payload, i


@pytest.mark.parametrize("case", ["below the floor", "full past the check"])
def test_a_file_system_below_its_floor_is_not_written_nor_retried_chunk_by_chunk(
    small_fs: Path, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below the floor, or full anyway (another writer filled it between the check and the
    write: the check let pass here): the chunks are held back, counted, never begun one by one
    against the full disk; what the tier holds reads back right; once the other file is gone,
    writing resumes."""
    floor = FLOOR if case == "below the floor" else 0
    tier = DiskTier(small_fs / "kv", "model-a", CHUNK, 2**40, min_free_bytes=floor)
    for i in range(4):
        tier.write("", *_chunk(i))
    tier.flush()
    assert tier.stats.num_written == 4
    filler = _fill_to(small_fs, floor // 2)
    if not floor:
        monkeypatch.setattr(DiskDir, "room_for", lambda self, n: True, raising=False)
    calls = _counting(monkeypatch)
    began = time.monotonic()
    for i in range(100, 300):
        tier.write("", *_chunk(i))
        if i % 20 == 0:
            tier.flush()
    tier.flush()
    periods = 1 + (time.monotonic() - began) / 1.0  # HoldBack's first period: 1 s
    s = tier.stats
    assert s.num_written == 4 and s.num_write_held + s.num_write_failed == 200, s
    assert s.num_write_failed <= periods, s  # full past the check: one write a period
    assert calls["mkstemp"] <= 1 + periods, calls  # not one per chunk
    assert calls["statvfs"] <= 2 * periods, calls
    if floor:
        assert _free(small_fs) >= floor // 2 and calls["mkstemp"] == 0
    _held_chunks_read_back(tier, range(4))
    filler.unlink()
    monkeypatch.undo()
    deadline = time.monotonic() + 10  # past HoldBack's second period (2 s)
    i = 1000
    while tier.stats.num_written == 4 and time.monotonic() < deadline:
        tier.write("", *_chunk(i))
        tier.flush()
        i += 1
        time.sleep(0.1)
    assert tier.stats.num_written == 5, tier.stats
    tier.close()


def test_the_oldest_chunks_make_way_to_keep_the_floor(small_fs: Path) -> None:
    tier = DiskTier(small_fs / "kv", "model-a", CHUNK, 2**40, min_free_bytes=FLOOR)
    for i in range(16):
        tier.write("", *_chunk(i))
        tier.flush()
    assert tier.stats.num_written == 16
    _fill_to(small_fs, FLOOR + PAYLOAD // 2)  # room for no chunk above the floor
    for i in range(100, 120):
        tier.write("", *_chunk(i))
        tier.flush()
        assert _free(small_fs) >= FLOOR, i
    s = tier.stats
    assert s.num_written == 36 and s.num_evicted >= 20 and s.num_write_failed == 0, s
    _held_chunks_read_back(tier, range(110, 120))  # the newest stay, right
    assert tier.read("", _chunk(0)[0]) is None  # the oldest went first
    tier.close()


def test_a_directory_under_a_parent_another_user_could_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone may rename kv away and put their own in its place
    with pytest.raises(
        InsecurePathError,
        match=rf"{shared} .*0777.*, a parent of {shared / 'a' / 'kv'}, is writable by group or "
        r"others \(and not sticky\): refused",
    ):
        DiskTier(shared / "a" / "kv", "model-a", CHUNK, 2**20)
    assert not (shared / "a").exists()  # refused before anything was made under it
    shared.chmod(0o1777)  # sticky, as /tmp: others cannot rename this user's names
    DiskTier(shared / "a" / "kv", "model-a", CHUNK, 2**20).close()
    if os.geteuid() == 0:  # only root can give a directory away
        mine = tmp_path / "given"
        mine.mkdir(mode=0o755)
        os.chown(mine, 65534, 65534)
        with pytest.raises(InsecurePathError, match=rf"{mine} \(owner uid 65534.*a parent of"):
            DiskTier(mine / "kv", "model-a", CHUNK, 2**20)
