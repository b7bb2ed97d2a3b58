"""The disk tier below the host tier (``pd.cache.disk_tier``), in plain Python with the path
mover of test_host_tier.py (each slot's "KV" names the prefix it belongs to): what the host
drops is written in chunks and loaded back from disk with the right KV; a node started on the
same directory finds and announces it; truncated, corrupt and foreign files (another model,
another tenant) are rejected, counted and removed; the directory stays within its bytes; nothing
leaks over many cycles."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pd.cache.disk_tier import DiskTier, chain_key
from pd.cache.host_tier import HostTier
from pd.cache.prefix_index import PrefixIndex
from pd.cache.radix_cache import RadixCache
from pd.core.kv_pool import SlotAllocator
from tests.cache.test_host_tier import PathMover, _prompt, _run

pytestmark = pytest.mark.timeout(60)
CHUNK = 8


def _make(
    root: Path,
    device_pages: int = 26,
    host_pages: int = 32,
    page_size: int = 1,
    key: str = "model-a",
    max_bytes: int = 2**30,
) -> tuple[RadixCache, HostTier, PathMover]:
    mover = PathMover(device_pages * page_size, host_pages * page_size)
    tier = HostTier(mover, page_size, DiskTier(root, key, CHUNK, max_bytes))
    allocator = SlotAllocator(device_pages * page_size, page_size)
    return RadixCache(allocator, "p0", lower=tier), tier, mover


def _push_down(cache: RadixCache, mover: PathMover, rng: random.Random, n: int = 3) -> None:
    """Unrelated traffic that pushes everything older out of the device and the host; then
    waits for the disk writer."""
    for _ in range(n):
        _run(cache, mover, _prompt(rng, 25))
    cache.lower.disk.flush()


def test_what_the_host_drops_comes_back_from_disk_with_its_kv(tmp_path: Path) -> None:
    cache, tier, mover = _make(tmp_path)
    rng = random.Random(0)
    a = _prompt(rng, 20)  # chunks [0, 8) and [8, 16) are whole; the last 4 tokens are not
    _run(cache, mover, a)
    _push_down(cache, mover, rng)
    assert tier.held_len(a, "") == 0 and cache.match_prefix(a[:1]).num_tokens == 0
    disk = tier.disk.stats
    assert disk.num_written >= 2
    assert _run(cache, mover, a + [7]) == 16  # _run checks each slot's KV
    assert tier.disk.stats.num_hit_tokens == 16 and tier.disk.stats.num_loads == 2
    cache.check_integrity()


def test_a_node_started_on_the_directory_finds_and_announces_it(tmp_path: Path) -> None:
    first, _, mover = _make(tmp_path)
    rng = random.Random(1)
    a = _prompt(rng, 24)
    _run(first, mover, a)
    _push_down(first, mover, rng, 4)
    # a replacement on the same host: a fresh cache over the same directory
    cache, tier, mover = _make(tmp_path, host_pages=128)
    mirror = PrefixIndex(1, "p0")
    for event in cache.take_events():
        assert mirror.apply(event)
    assert mirror.match_len(a) == 24  # announced: the coordinator can route a's turns here
    assert tier.held_len(a, "") == 24  # read up into the host tier while it had room
    assert _run(cache, mover, a + [3]) == 24
    cache.check_integrity()


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "other model", "other tenant"])
def test_a_damaged_or_foreign_file_is_rejected_counted_and_removed(
    tmp_path: Path, damage: str
) -> None:
    rng = random.Random(2)
    a = _prompt(rng, 16)
    if damage == "other model":  # the same tokens written by another model
        other, _, mover = _make(tmp_path, key="model-b")
        _run(other, mover, a)
        _push_down(other, mover, rng, 4)
        for f in (tmp_path / "model-b").iterdir():  # placed where model-a would look
            target = tmp_path / "model-a"
            target.mkdir(exist_ok=True)
            f.rename(target / f.name)
        # under the names model-a looks for (which file gets which name does not matter:
        # each says model-b inside)
        files = sorted((tmp_path / "model-a").iterdir())
        names = [chain_key("model-a", "", a[:end]) + ".kv" for end in (8, 16)]
        for f, name in zip(files, names):
            f.rename(f.parent / name)
    else:
        ns = "tenant-a" if damage == "other tenant" else ""
        writer, _, mover = _make(tmp_path)
        _run(writer, mover, a, ns)
        _push_down(writer, mover, rng, 4)
        files = {end: tmp_path / "model-a" / (chain_key("model-a", ns, a[:end]) + ".kv")
                 for end in (8, 16)}  # fmt: skip
        assert all(f.exists() for f in files.values())
        if damage == "truncated":
            data = files[8].read_bytes()
            files[8].write_bytes(data[: len(data) // 2])
        elif damage == "corrupt":
            data = bytearray(files[8].read_bytes())
            data[-3] ^= 0xFF
            files[8].write_bytes(bytes(data))
        else:  # tenant a's files placed where tenant b's would be
            for end, f in files.items():
                f.rename(f.parent / (chain_key("model-a", "tenant-b", a[:end]) + ".kv"))
    cache, tier, mover = _make(tmp_path, host_pages=4)  # too small to read anything up
    rejected = tier.disk.stats.num_rejected  # the start-up scan already checks every file
    ns = "tenant-b" if damage == "other tenant" else ""
    assert _run(cache, mover, a + [1], ns) == 0
    assert rejected + tier.disk.stats.num_rejected >= 1
    left = list((tmp_path / "model-a").glob("*.kv"))
    assert chain_key("model-a", ns, a[:8]) + ".kv" not in {f.name for f in left}
    cache.check_integrity()


def test_the_directory_stays_within_its_bytes_oldest_first(tmp_path: Path) -> None:
    cache, tier, mover = _make(tmp_path, max_bytes=6000)
    rng = random.Random(3)
    for _ in range(30):
        _run(cache, mover, _prompt(rng, 16))
        tier.disk.flush()
    files = list((tmp_path / "model-a").glob("*.kv"))
    assert 0 < sum(f.stat().st_size for f in files) <= 6000
    assert tier.disk.stats.num_evicted > 0 and tier.disk.stats.num_written > len(files)


def test_no_slot_host_page_or_file_handle_leaks_over_fifty_cycles(tmp_path: Path) -> None:
    import os

    fds = len(os.listdir("/proc/self/fd"))
    cache, tier, mover = _make(tmp_path, device_pages=12, host_pages=8, page_size=4)
    rng = random.Random(4)
    prompts = [_prompt(rng, rng.randrange(8, 40)) for _ in range(6)]
    for _ in range(50):
        _run(cache, mover, rng.choice(prompts) + _prompt(rng, 2), ns=rng.choice(["", "t"]))
        cache.check_integrity()
        tier.disk.flush()
    assert tier.disk.stats.num_hit_tokens > 0
    cache.evict(cache.num_evictable_tokens)
    assert cache.num_cached_tokens == 0 and cache.allocator.num_free_slots == 48
    assert tier.num_cached_tokens + tier.allocator.num_free_slots == 32
    tier.disk.close()  # the writer thread ends; nothing of it stays open
    assert len(os.listdir("/proc/self/fd")) == fds
    assert not list((tmp_path / "model-a").glob(".tmp-*"))
