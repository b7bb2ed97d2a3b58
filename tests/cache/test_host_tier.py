"""The host tier below a RadixCache (``pd.cache.host_tier``), in plain Python: a mover whose
"KV" of a token is the (namespace, path up to it) it was computed for, so every loaded slot can
be checked for holding exactly the right prefix. Eviction saves down, matches load back,
tenants stay apart, the tier drops its least recently used paths, the coordinator's mirror
stays equal to what the node holds in either tier, nothing leaks over many cycles, and a load
measured slower than recomputing is skipped. The engine with real KV: tests/engine/test_host_tier.py.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd.cache.host_tier import BaseKVMover, HostTier
from pd.cache.prefix_index import PrefixIndex
from pd.cache.radix_cache import RadixCache
from pd.core.kv_pool import SlotAllocator

pytestmark = pytest.mark.timeout(60)

KV = tuple[str, tuple[int, ...]]  # what a slot holds: (namespace, the path up to its token)


class PathMover(BaseKVMover):
    """Device and host "pools" of Python values; ``save``/``load`` copy them slot by slot."""

    num_bytes_per_token = 1000

    def __init__(self, num_device_slots: int, num_slots: int) -> None:
        self.num_slots = num_slots
        self.device: list[KV | None] = [None] * num_device_slots
        self.host: list[KV | None] = [None] * num_slots
        self.num_saved = self.num_loaded = 0

    def save(self, device_slots: Sequence[int], host_slots: Sequence[int]) -> None:
        for d, h in zip(device_slots, host_slots, strict=True):
            assert self.device[d] is not None, f"device slot {d} saved before it was written"
            self.host[h] = self.device[d]
        self.num_saved += len(host_slots)

    def load(self, host_slots: Sequence[int], device_slots: Sequence[int]) -> None:
        for h, d in zip(host_slots, device_slots, strict=True):
            self.device[d] = self.host[h]
        self.num_loaded += len(host_slots)

    def host_bytes(self, host_slots: Sequence[int]) -> bytes:
        return json.dumps([self.host[h] for h in host_slots]).encode()

    def device_bytes(self, device_slots: Sequence[int]) -> bytes:
        return json.dumps([self.device[d] for d in device_slots]).encode()

    def load_bytes(self, payload: memoryview, skip: int, device_slots: Sequence[int]) -> None:
        kv = [(ns, tuple(path)) for ns, path in json.loads(bytes(payload))]
        for value, d in zip(kv[skip:], device_slots, strict=True):
            self.device[d] = value

    def store_bytes(self, payload: memoryview, skip: int, host_slots: Sequence[int]) -> None:
        kv = [(ns, tuple(path)) for ns, path in json.loads(bytes(payload))]
        for value, h in zip(kv[skip:], host_slots, strict=True):
            self.host[h] = value


def _make(
    device_pages: int, host_pages: int, page_size: int = 1
) -> tuple[RadixCache, HostTier, PathMover]:
    mover = PathMover(device_pages * page_size, host_pages * page_size)
    tier = HostTier(mover, page_size)
    allocator = SlotAllocator(device_pages * page_size, page_size)
    return RadixCache(allocator, "p0", lower=tier), tier, mover


def _run(cache: RadixCache, mover: PathMover, tokens: list[int], ns: str = "") -> int:
    """One request start to finish, computing ("writing KV" for) what the cache lacks and
    checking what it found; returns the matched length."""
    m = cache.match_prefix(tokens, ns)
    for i, slot in enumerate(m.slots):
        assert mover.device[slot] == (ns, tuple(tokens[: i + 1])), f"slot {slot} of token {i}"
    cache.inc_lock_ref(m.last_node)
    cache.make_room(cache.allocator.num_new_pages(m.slots, len(tokens)) * cache.page_size)
    slots = cache.allocator.extend(m.slots, len(tokens))
    for i in range(m.num_tokens, len(tokens)):
        mover.device[slots[i]] = (ns, tuple(tokens[: i + 1]))
    cache.cache_finished(tokens, slots, m.last_node, ns)
    return m.num_tokens


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(n)]


def test_an_evicted_prefix_is_loaded_back_with_its_kv() -> None:
    cache, tier, mover = _make(device_pages=40, host_pages=100)
    rng = random.Random(0)
    a, b = _prompt(rng, 30), _prompt(rng, 30)
    assert _run(cache, mover, a) == 0
    assert _run(cache, mover, b) == 0  # pushes 20 of a's tokens down to the host
    assert tier.num_cached_tokens == 30 and mover.num_saved == 30  # a's whole path, once
    assert cache.num_cached_tokens == 40
    assert _run(cache, mover, a + [5]) == 30  # 10 on the device, 20 loaded back
    assert tier.stats.num_hit_tokens == 20 and tier.stats.num_loads == 1
    assert cache.stats.num_hit_tokens == 30
    cache.check_integrity()
    assert cache.num_evictable_tokens == cache.num_cached_tokens


def test_each_token_is_copied_down_once_however_often_its_path_is_evicted() -> None:
    cache, tier, mover = _make(device_pages=16, host_pages=64)
    rng = random.Random(1)
    system, others = _prompt(rng, 10), [_prompt(rng, 16) for _ in range(4)]
    for i in range(4):
        _run(cache, mover, system + [i, i, i])
        _run(cache, mover, others[i])
    # the shared system prompt went down once; each question's 3 tokens once
    assert mover.num_saved == tier.stats.num_saved_tokens <= 10 + 4 * 3 + 4 * 16
    cache.check_integrity()


def test_tenants_never_hit_each_others_prefixes_in_the_host_tier() -> None:
    cache, tier, mover = _make(device_pages=24, host_pages=100)
    rng = random.Random(2)
    secret = _prompt(rng, 20)
    _run(cache, mover, secret, ns="tenant-a")
    _run(cache, mover, _prompt(rng, 20), ns="tenant-a")  # pushes the secret down
    assert tier.held_len(secret, "tenant-a") == 20
    assert _run(cache, mover, secret + [1], ns="tenant-b") == 0
    assert _run(cache, mover, secret + [1], ns="tenant-a") == 20  # _run checks the KV's tenant
    cache.check_integrity()


def test_a_full_tier_drops_its_least_recently_used_paths() -> None:
    cache, tier, mover = _make(device_pages=12, host_pages=20)
    rng = random.Random(3)
    prompts = [_prompt(rng, 10) for _ in range(5)]
    for p in prompts:
        _run(cache, mover, p)
    # the device holds the last one, the tier the two before it; the first two are gone
    assert [tier.held_len(p, "") for p in prompts] == [0, 0, 10, 10, 0]
    assert cache.match_prefix(prompts[4]).num_tokens == 10
    assert tier.stats.num_dropped_tokens == 20
    assert _run(cache, mover, prompts[0] + [1]) == 0  # pushes prompts[4] down, over [2]
    assert [tier.held_len(p, "") for p in prompts] == [0, 0, 0, 10, 10]
    assert _run(cache, mover, prompts[3] + [1]) == 10
    cache.check_integrity()


def test_a_load_measured_slower_than_computing_is_skipped() -> None:
    cache, tier, mover = _make(device_pages=24, host_pages=100)
    rng = random.Random(4)
    a = _prompt(rng, 20)
    _run(cache, mover, a)
    _run(cache, mover, _prompt(rng, 20))
    tier.load_rate.add(1000 * 10, 1.0)  # 10 tokens/s of 1000 bytes each
    cache.note_prefill(1000, 1.0)  # computing: 1000 tokens/s
    assert _run(cache, mover, a + [1]) == 4  # what the device kept; the 16 below computed
    assert tier.stats.num_skipped == 1 and tier.stats.num_loads == 0
    _run(cache, mover, _prompt(rng, 20))  # a goes down again
    for _ in range(40):  # computing became far slower than the measured load
        cache.note_prefill(1, 1.0)
    assert _run(cache, mover, a + [2]) == 20 and tier.stats.num_loads == 1
    cache.check_integrity()


def test_no_slot_or_host_page_leaks_over_fifty_cycles_of_evict_and_load_back() -> None:
    cache, tier, mover = _make(device_pages=12, host_pages=24, page_size=4)
    rng = random.Random(5)
    prompts = [_prompt(rng, rng.randrange(8, 40)) for _ in range(8)]
    for _ in range(50):
        p = rng.choice(prompts)
        _run(cache, mover, p + _prompt(rng, 3), ns=rng.choice(["", "t"]))
        cache.check_integrity()
    assert tier.stats.num_hit_tokens > 0 and tier.stats.num_dropped_tokens > 0
    cache.evict(cache.num_evictable_tokens)
    assert cache.num_cached_tokens == 0 and cache.allocator.num_free_slots == 48
    tier.check_integrity()
    assert tier.num_cached_tokens + tier.allocator.num_free_slots == 96


@pytest.mark.parametrize("page_size", [1, 4])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_the_mirror_holds_what_either_tier_holds(
    page_size: int, data: st.DataObject
) -> None:
    """The coordinator's mirror, replaying the cache's events, answers for every prompt the
    longer of what the device and the host tier hold; and a snapshot rebuilds the same."""
    cache, tier, mover = _make(device_pages=6, host_pages=10, page_size=page_size)
    mirror = PrefixIndex(page_size, "p0")
    seen: list[tuple[list[int], str]] = []
    pages = st.lists(st.integers(0, 2), min_size=1, max_size=5)
    for _ in range(data.draw(st.integers(1, 20), label="steps")):
        tokens = [t for p in data.draw(pages) for t in [p] * page_size]
        tokens += data.draw(st.lists(st.integers(0, 2), max_size=page_size))
        ns = data.draw(st.sampled_from(["", "t"]))
        if data.draw(st.booleans()):
            _run(cache, mover, tokens, ns)
        else:
            cache.evict(data.draw(st.integers(1, 3)) * page_size)
        seen.append((tokens, ns))
        for event in cache.take_events():
            assert mirror.apply(event)
        cache.check_integrity()
        for t, n in seen:
            held = max(cache._tree.held_len(t, n), tier.held_len(t, n))
            assert mirror.match_len(t, n) == held, (t, n)
    rebuilt = PrefixIndex(page_size, "p0")
    rebuilt.apply_snapshot(cache.take_snapshot())
    for t, n in seen:
        assert rebuilt.match_len(t, n) == mirror.match_len(t, n), (t, n)
