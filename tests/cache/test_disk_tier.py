"""The disk tier below the host tier (``pd.cache.disk_tier``), in plain Python with the path
mover of test_host_tier.py (each slot's "KV" names the prefix it belongs to): what the host
drops is written in chunks and loaded back from disk with the right KV; a node started on the
same directory finds and announces it; truncated, corrupt and foreign files (another model,
another tenant) are rejected, counted and removed; the directory stays within its bytes; nothing
leaks over many cycles.

And what the directory must not be trusted with (real directories, real modes): a chunk planted
with its own checksum, a directory another user could write, several nodes writing one
directory, a match on a prompt whose load does not pay, a header nested deep, a directory that
turns read-only or vanishes mid-run. Tests may run as root, whom modes do not stop: there a
directory is made read-only with ``chattr +i`` (ext4 here), as a user with ``chmod``."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import random
import stat
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from pd.cache import chunk_file
from pd.cache.chunk_file import chain_key
from pd.cache.disk_tier import DiskTier
from pd.cache.host_tier import HostTier
from pd.cache.prefix_index import PrefixIndex
from pd.cache.radix_cache import RadixCache
from pd.core.kv_pool import SlotAllocator
from pdtools.disk_faults import CannotHarm, forged_chunk, make_read_only
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


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _make_read_only(d: Path) -> Callable[[], None]:
    """Make the directory ``d`` and its files unwritable by this process (a file system gone
    read-only): ``chmod`` as a user, ``chattr +i`` as root (whom modes do not stop); -> undo."""
    try:
        return make_read_only(d)
    except CannotHarm as e:
        pytest.skip(str(e))


def _make_vanish(d: Path) -> Callable[[], None]:
    """Put a file where the directory ``d`` is (it was removed and something else made)."""
    d.rename(d.with_name(d.name + ".gone"))
    d.write_bytes(b"not a directory")
    return lambda: None


def test_a_chunk_planted_with_its_own_checksum_is_rejected_unread(tmp_path: Path) -> None:
    """Someone who can write the directory but does not hold its key plants, under a's name,
    a chunk whose payload is b's KV and whose header carries that payload's right sha256."""
    root = tmp_path / "kv"
    cache, tier, mover = _make(root)
    rng = random.Random(7)
    a, b = _prompt(rng, 16), _prompt(rng, 16)
    wrong_kv = [["", b[: i + 1]] for i in range(CHUNK)]  # PathMover's payload: b's KV
    # its own key, if any: what the planter's DiskTier makes in its own directory
    name, data = forged_chunk(
        "model-a", "", a[:CHUNK], json.dumps(wrong_kv).encode(), tmp_path / "elsewhere"
    )
    assert name == chain_key("model-a", "", a[:CHUNK]) + ".kv"
    (root / "model-a" / name).write_bytes(data)
    assert _run(cache, mover, a + [1]) == 0  # _run checks every slot's KV: none came from it
    assert tier.disk.stats.num_rejected == 1 and tier.disk.stats.num_hit_tokens == 0
    assert not (root / "model-a" / name).exists()
    cache.check_integrity()


def test_the_directory_is_made_0700_and_one_another_user_could_write_is_refused(
    tmp_path: Path,
) -> None:
    root = tmp_path / "kv"
    DiskTier(root, "model-a", CHUNK, 2**20).close()
    assert _mode(root) == 0o700 and _mode(root / "model-a") == 0o700
    root.chmod(0o777)
    with pytest.raises(PermissionError, match=rf"{root} .*0777.* writable by group or others"):
        DiskTier(root, "model-a", CHUNK, 2**20)
    root.chmod(0o755)  # an older pd's directory, owned by this user: made private
    DiskTier(root, "model-a", CHUNK, 2**20).close()
    assert _mode(root) == 0o700
    (root / "model-a").chmod(0o770)
    with pytest.raises(PermissionError, match=rf"{root / 'model-a'} .*0770"):
        DiskTier(root, "model-a", CHUNK, 2**20)
    (root / "model-a").chmod(0o700)
    key = root / ".pd-key"
    key.chmod(0o644)
    with pytest.raises(PermissionError, match=rf"{key} \(mode 0644\) is open to group or others"):
        DiskTier(root, "model-a", CHUNK, 2**20)
    key.chmod(0o600)
    if os.geteuid() == 0:  # only root can give a directory away
        os.chown(root, 65534, 65534)
        with pytest.raises(PermissionError, match=rf"{root} \(owner uid 65534.* another user"):
            DiskTier(root, "model-a", CHUNK, 2**20)


def test_nodes_sharing_a_directory_keep_it_within_its_bound_together(tmp_path: Path) -> None:
    nodes = [_make(tmp_path, max_bytes=6000) for _ in range(4)]  # four nodes of one host
    rng = random.Random(5)
    most = 0  # the most the directory held after any write
    for i in range(48):
        cache, tier, mover = nodes[i % 4]
        _run(cache, mover, _prompt(rng, 16))
        tier.disk.flush()
        most = max(most, sum(f.stat().st_size for f in tmp_path.glob("*/*.kv")))
    sizes = [f.stat().st_size for f in tmp_path.glob("*/*.kv")]
    assert 0 < sum(sizes) <= most <= 6000, (len(sizes), sum(sizes), most)
    stats = [tier.disk.stats for _, tier, _ in nodes]
    assert sum(s.num_written for s in stats) > len(sizes) and sum(s.num_evicted for s in stats)
    assert all(s.num_bytes >= sum(sizes) for s in stats)  # the shared count: high, never low


def test_a_match_reads_no_chunk_until_loading_pays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, tier, mover = _make(tmp_path)
    rng = random.Random(8)
    a = _prompt(rng, 20)
    _run(cache, mover, a)
    _push_down(cache, mover, rng)
    assert tier.disk is not None and cache.match_prefix(a[:1]).num_tokens == 0
    read = tier.disk.read
    reads: list[int] = []
    monkeypatch.setattr(tier.disk, "read", lambda ns, p: reads.append(len(p)) or read(ns, p))
    tier.prefill_rate.value, tier.disk_rate.value = 1e9, 1.0  # computing is far faster
    for _ in range(3):  # a request waiting is matched again each step
        assert cache.match_prefix(a + [7]).num_tokens == 0
    assert reads == [] and tier.stats.num_skipped == 3
    tier.prefill_rate.value, tier.disk_rate.value = 1.0, 1e12  # now loading pays
    assert _run(cache, mover, a + [7]) == 16
    assert reads == [8, 16] and tier.disk.stats.num_loads == 2  # each chunk read once
    cache.check_integrity()


def test_a_header_nested_deep_or_too_long_is_rejected_and_counted_never_raised(
    tmp_path: Path,
) -> None:
    """Headers that pass the tag (as a buggy writer holding the key would leave them) but are
    nested 100,000 deep (JSON and msgpack), or that claim 4 GiB: a node starting on the
    directory, and a read, skip and count each."""
    _, tier, _ = _make(tmp_path)
    assert tier.disk is not None
    key = tmp_path / ".pd-key"
    bodies = [
        b"[" * 100_000 + b"]" * 100_000,
        b"\x91" * 100_000 + b"\x01",
        b'{"key": "model-a", "tokens": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ]
    paths = [[i] * CHUNK for i in range(len(bodies) + 1)]
    for body, path in zip([*bodies, None], paths):
        if body is None:  # a length of 4 GiB - 1, on a file of 80 bytes
            data = chunk_file.MAGIC + struct.pack("<I", 2**32 - 1) + b"x" * 70
        else:
            data = chunk_file.MAGIC + struct.pack("<I", len(body)) + body
            if key.exists():
                data += hmac.new(key.read_bytes(), data, hashlib.sha256).digest()
            data += b"\0" * 16
        (tmp_path / "model-a" / (chain_key("model-a", "", path) + ".kv")).write_bytes(data)
    cache, tier, mover = _make(tmp_path)  # its start-up scan reads every header
    assert tier.disk is not None and tier.disk.stats.num_rejected == len(paths)
    assert not list((tmp_path / "model-a").glob("*.kv")) and not tier.disk.stats.is_off
    assert _run(cache, mover, paths[0] + [1]) == 0
    cache.check_integrity()


@pytest.mark.parametrize("failure", ["read-only", "vanished"])
def test_a_directory_that_fails_mid_run_turns_the_tier_off_and_the_cache_serves_on(
    tmp_path: Path, failure: str
) -> None:
    cache, tier, mover = _make(tmp_path)
    assert tier.disk is not None
    rng = random.Random(9)
    a = _prompt(rng, 24)
    _run(cache, mover, a)
    _push_down(cache, mover, rng, 4)  # a: on disk only
    written = tier.disk.stats.num_written
    undo = (_make_read_only if failure == "read-only" else _make_vanish)(tmp_path / "model-a")
    try:
        for i in range(4):  # a's chunks found, refreshed, read; new ones written: all fail
            assert _run(cache, mover, a + [i]) in (0, 24) or i  # its KV checked, whatever hit
            _push_down(cache, mover, rng)
        disk = tier.disk.stats
        assert disk.is_off and disk.num_written == written
        assert tier.disk.match(a, "", 0) == [] and tier.disk.scan() == []
        assert _run(cache, mover, a + [9]) >= 0  # serves on, the tier off
        cache.check_integrity()
    finally:
        undo()


def test_checkpoints_alike_in_names_and_sizes_but_not_weights_get_other_model_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model key hashes the weights' contents, once: the digest is kept beside them and
    taken again only for a file that changed (here: other bytes, the same size and mtime)."""
    import torch

    from pd.core.kv_pool import KVPool
    from pd.executor.config import EngineConfig
    from pd.executor.host_pool import make_disk_tier
    from pd.model import loader

    hashed: list[str] = []
    digest = loader._file_digest
    monkeypatch.setattr(loader, "_file_digest", lambda p: hashed.append(p.name) or digest(p))
    pool = KVPool(2, 16, 2, 8, torch.float32)

    def key(model: Path) -> str:
        cfg = EngineConfig(model=str(model), disk_cache_dir=str(tmp_path / "kv"))
        tier = make_disk_tier(cfg, model, pool, "none", pool.num_kv_heads)
        assert tier is not None
        tier.close()
        return tier.key

    models = [tmp_path / "a", tmp_path / "b"]
    for i, m in enumerate(models):
        m.mkdir()
        (m / "config.json").write_text("{}")
        (m / "model.safetensors").write_bytes(bytes([i]) * 4096)
    first = [key(m) for m in models]
    assert first[0] != first[1] and hashed == ["model.safetensors"] * 2
    assert [key(m) for m in models] == first and len(hashed) == 2  # kept beside the weights
    weights = models[0] / "model.safetensors"
    st = weights.stat()
    weights.write_bytes(bytes([7]) * 4096)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same size and mtime
    assert key(models[0]) not in first and len(hashed) == 3
