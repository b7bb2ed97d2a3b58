"""RadixCache: unit scenarios, and a property test against a plain page-set reference model."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd.cache.base import NoPrefixCache
from pd.cache.radix_cache import RadixCache
from pd.cache.radix_tree import RadixNode
from pd.cache.tenants import TenantShares, tenant_of
from pd.core.kv_pool import SlotAllocator


def _make_cache(num_pages: int = 64, page_size: int = 1) -> tuple[RadixCache, SlotAllocator]:
    allocator = SlotAllocator(num_pages * page_size, page_size)
    return RadixCache(allocator, node_id="p0"), allocator


def _run(cache: RadixCache, tokens: list[int], namespace: str = "") -> int:
    """One request start to finish; returns its matched prefix length."""
    m = cache.match_prefix(tokens, namespace)
    cache.inc_lock_ref(m.last_node)
    slots = cache.allocator.extend(m.slots, len(tokens))
    cache.cache_finished(tokens, slots, m.last_node, namespace)
    return m.num_tokens


def _check(cache: RadixCache, running: list[tuple[list[int], RadixNode]] = ()) -> None:
    cache.check_integrity()
    cache.check_slot_ownership(running)


@pytest.mark.timeout(10)
def test_match_splits_node_and_shares_prefix() -> None:
    cache, allocator = _make_cache()
    _run(cache, [1, 2, 3, 4, 5, 6])
    m = cache.match_prefix([1, 2, 3, 9])
    assert m.num_tokens == 3 and m.slots == [0, 1, 2]
    assert m.last_node.key == (1, 2, 3) and list(m.last_node.children) == [(4,)]
    assert _run(cache, [1, 2, 3, 7, 8]) == 3
    assert cache.num_cached_tokens == 8
    assert allocator.num_used_slots == 8
    assert cache.match_prefix([1, 2, 3, 7, 8, 0]).slots == [0, 1, 2, 6, 7]
    _check(cache)


@pytest.mark.timeout(10)
def test_page_alignment_frees_tail_and_matches_whole_pages() -> None:
    cache, allocator = _make_cache(page_size=4)
    tokens = list(range(10))
    assert _run(cache, tokens) == 0
    assert cache.num_cached_tokens == 8  # 2 full pages; the 2-token tail page was freed
    assert allocator.num_used_slots == 8
    assert cache.match_prefix(list(range(7))).num_tokens == 4
    assert cache.match_prefix(list(range(8)) + [0]).num_tokens == 8
    assert cache.match_prefix([0, 1, 2, 9, 4]).num_tokens == 0  # diverges inside page 0
    _check(cache)


@pytest.mark.timeout(10)
def test_duplicate_pages_are_freed_and_cache_slots_returned() -> None:
    cache, allocator = _make_cache(page_size=2)
    tokens = [5, 6, 7, 8, 9]
    a = cache.match_prefix(tokens)
    b = cache.match_prefix(tokens)
    cache.inc_lock_ref(a.last_node)
    cache.inc_lock_ref(b.last_node)
    slots_a = allocator.extend(a.slots, 5)  # pages 0,1,2
    slots_b = allocator.extend(b.slots, 5)  # pages 3,4,5
    a2 = cache.cache_unfinished(tokens, slots_a, a.last_node)
    assert a2.slots == slots_a and a2.num_tokens == 5
    b2 = cache.cache_unfinished(tokens, slots_b, b.last_node)
    # b computed the same 4 aligned tokens: its pages 3,4 go back, it now reads a's slots.
    assert b2.slots == slots_a[:4] + slots_b[4:]
    assert b2.last_node is a2.last_node and a2.last_node.lock_ref == 2
    assert allocator.num_used_slots == 2 * 4  # tree pages 0,1 + tail pages 2 and 5
    _check(cache, [(a2.slots, a2.last_node), (b2.slots, b2.last_node)])
    cache.cache_finished(tokens, a2.slots, a2.last_node)
    cache.cache_finished(tokens, b2.slots, b2.last_node)
    assert allocator.num_used_slots == 4 and cache.num_protected_tokens == 0
    _check(cache)


@pytest.mark.timeout(10)
def test_namespaces_are_separate_subtrees() -> None:
    cache, _ = _make_cache()
    _run(cache, [1, 2, 3], namespace="lora-a")
    assert cache.match_prefix([1, 2, 3]).num_tokens == 0
    assert cache.match_prefix([1, 2, 3], "lora-b").num_tokens == 0
    assert cache.match_prefix([1, 2, 3], "lora-a").num_tokens == 3
    assert _run(cache, [1, 2, 3]) == 0
    assert cache.num_cached_tokens == 6
    events = cache.take_events()
    assert [(e.kind, e.namespace) for e in events] == [("inserted", "lora-a"), ("inserted", "")]
    _check(cache)


@pytest.mark.timeout(10)
def test_evicts_least_recently_used_leaf_first_and_trims_by_page() -> None:
    cache, allocator = _make_cache(page_size=2)
    _run(cache, [1, 1, 2, 2])  # A
    _run(cache, [3, 3, 4, 4])  # B
    _run(cache, [5, 5, 6, 6])  # C
    cache.match_prefix([1, 1, 2, 2])  # A is now the most recent
    cache.take_events()
    assert cache.evict(3) == 4  # all of B (least recent)
    assert cache.match_prefix([3, 3]).num_tokens == 0
    assert cache.evict(1) == 2  # one page off the end of C
    assert cache.match_prefix([5, 5, 6, 6]).num_tokens == 2
    assert cache.match_prefix([1, 1, 2, 2]).num_tokens == 4
    assert [(e.kind, e.tokens, e.num_evicted) for e in cache.take_events()] == [
        ("evicted", [3, 3, 4, 4], 4),
        ("evicted", [5, 5, 6, 6], 2),
    ]
    assert cache.stats.num_evicted_tokens == 6 and allocator.num_used_slots == 6
    _check(cache)


@pytest.mark.timeout(10)
def test_locked_path_is_never_evicted() -> None:
    cache, allocator = _make_cache()
    _run(cache, [1, 2, 3, 4])
    _run(cache, [1, 2, 9])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(m.last_node)
    assert cache.num_protected_tokens == 4 and cache.num_evictable_tokens == 1
    assert cache.evict(100) == 1  # only [9]
    assert cache.match_prefix([1, 2, 3, 4]).num_tokens == 4
    cache.dec_lock_ref(m.last_node)
    assert cache.evict(100) == 4 and cache.num_cached_tokens == 0
    assert allocator.num_free_slots == allocator.num_slots
    _check(cache)


@pytest.mark.timeout(10)
def test_parent_becomes_evictable_after_its_children_go() -> None:
    cache, _ = _make_cache()
    _run(cache, [1, 2, 3])
    _run(cache, [1, 2, 4])
    _run(cache, [7])
    cache.match_prefix([7])  # [7] most recent: the [1,2] branch goes entirely first
    assert cache.evict(4) == 4
    assert cache.match_prefix([7]).num_tokens == 1
    _check(cache)


@pytest.mark.timeout(10)
def test_whole_prompt_hit_still_computes_last_token_and_make_room_evicts() -> None:
    cache, allocator = _make_cache(num_pages=4, page_size=4)
    prompt = list(range(8))
    _run(cache, prompt)
    m = cache.match_prompt(prompt)
    assert m.num_tokens == 4  # prompt[:-1] = 7 tokens -> one whole page
    assert not cache.make_room(17) and cache.num_cached_tokens == 0  # evicted all it could
    assert cache.make_room(16) and allocator.can_allocate(16)
    _check(cache)


@pytest.mark.timeout(10)
def test_wrong_slot_count_is_refused_and_ownership_check_catches_leaks() -> None:
    cache, allocator = _make_cache()
    m = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(m.last_node)
    slots = allocator.extend(m.slots, 3)
    with pytest.raises(ValueError, match="3 tokens, 2 slots"):
        cache.cache_finished([1, 2, 3], slots[:2], m.last_node)
    with pytest.raises(AssertionError, match="leaked"):
        cache.check_slot_ownership([])
    cache.check_slot_ownership([(slots, m.last_node)])


@pytest.mark.timeout(10)
def test_snapshot_resets_and_replays_the_cache() -> None:
    cache, _ = _make_cache()
    _run(cache, [1, 2, 3])
    _run(cache, [1, 5])
    snap = cache.take_snapshot()
    assert snap[0].kind == "reset" and snap[0].seq == 2
    assert sorted(e.tokens for e in snap[1:]) == [[1, 2, 3], [1, 5]]
    assert cache.take_events() == [] and cache.events.next_seq == 5


@pytest.mark.timeout(10)
def test_no_prefix_cache_matches_nothing_and_frees_everything() -> None:
    allocator = SlotAllocator(16, 4)
    cache = NoPrefixCache(allocator)
    m = cache.match_prompt([1, 2, 3, 4, 5])
    cache.inc_lock_ref(m.last_node)
    slots = allocator.extend(m.slots, 5)
    m2 = cache.cache_unfinished([1, 2, 3, 4, 5], slots, m.last_node)
    assert m2.slots == slots and m2.num_tokens == 5
    cache.check_slot_ownership([(m2.slots, m2.last_node)])
    cache.cache_finished([1, 2, 3, 4, 5], m2.slots, m2.last_node)
    assert allocator.num_free_slots == 16 and cache.stats.hit_rate == 0.0
    assert cache.evict(4) == 0 and cache.take_events() == []


# -- property test: RadixCache against a reference model ---------------------------------------


class _RefCache:
    """The cache as a flat dict: every cached page-prefix (namespace, tokens[:k*ps]) with its
    last access time and lock count. Eviction removes the least recently used leaf page."""

    def __init__(self, page_size: int, shares: TenantShares | None = None) -> None:
        self.ps = page_size
        self.shares = shares  # fair: the page comes from the tenant most over its share
        self.time: dict[tuple[str, tuple[int, ...]], int] = {}
        self.locks: Counter[tuple[str, tuple[int, ...]]] = Counter()
        self.clock = 0

    def _pages(self, tokens: list[int], ns: str, num_tokens: int) -> list[tuple]:
        return [(ns, tuple(tokens[:end])) for end in range(self.ps, num_tokens + 1, self.ps)]

    def match(self, tokens: list[int], ns: str) -> int:
        self.clock += 1
        n = 0
        for page in self._pages(tokens, ns, len(tokens)):
            if page not in self.time:
                break
            self.time[page] = self.clock
            n += self.ps
        return n

    def insert(self, tokens: list[int], ns: str) -> None:
        self.clock += 1
        aligned = len(tokens) - len(tokens) % self.ps
        for page in self._pages(tokens, ns, aligned):
            self.time[page] = self.clock

    def lock(self, tokens: list[int], ns: str, num_tokens: int, delta: int) -> None:
        for page in self._pages(tokens, ns, num_tokens):
            self.locks[page] += delta
            assert self.locks[page] >= 0

    def evict(self, num_tokens: int) -> int:
        freed = 0
        while freed < num_tokens:
            parents = {(ns, p[: -self.ps]) for ns, p in self.time}
            leaves = [p for p in self.time if p not in parents and not self.locks[p]]
            if not leaves:
                break
            if self.shares is not None:
                shares = self.shares
                usage = Counter(tenant_of(ns) for ns, _ in self.time)
                most = max(
                    {tenant_of(ns) for ns, _ in leaves},
                    key=lambda t: (usage[t] * self.ps / shares.weight(t), t),
                )
                leaves = [p for p in leaves if tenant_of(p[0]) == most]
            times = sorted(self.time[p] for p in leaves)
            assert len(times) < 2 or times[0] < times[1], "LRU tie: the order is not defined"
            del self.time[min(leaves, key=self.time.__getitem__)]
            freed += self.ps
        return freed

    @property
    def num_cached(self) -> int:
        return len(self.time) * self.ps

    @property
    def num_protected(self) -> int:
        return sum(1 for p in self.time if self.locks[p]) * self.ps


@dataclass
class _Req:
    tokens: list[int]
    ns: str
    slots: list[int]
    node: RadixNode
    num_locked: int  # tokens of its locked path (the cache's slots), the rest it owns


def _tokens(page_size: int) -> st.SearchStrategy[list[int]]:
    """Sequences over a tiny alphabet so that prefixes are shared and diverge inside pages."""
    if page_size == 1:
        return st.lists(st.integers(0, 2), min_size=1, max_size=12)
    page = st.builds(
        lambda a, j, b: [a] * j + [b] * (page_size - j),
        st.integers(0, 2),
        st.integers(1, page_size),
        st.integers(0, 2),
    )
    return st.builds(
        lambda pages, tail: [t for p in pages for t in p] + pages[-1][:tail],
        st.lists(page, min_size=1, max_size=4),
        st.integers(0, page_size - 1),
    )


class _Driver:
    def __init__(self, page_size: int, num_pages: int, shares: TenantShares | None) -> None:
        self.ps = page_size
        self.allocator = SlotAllocator(num_pages * page_size, page_size)
        self.cache = RadixCache(self.allocator, "p0", shares=shares)
        self.ref = _RefCache(page_size, shares)
        self.running: list[_Req] = []
        self.readers: list[tuple[list[int], str, int, RadixNode]] = []

    def match_and_lock(self, tokens: list[int], ns: str) -> tuple[list[int], RadixNode, int]:
        m = self.cache.match_prefix(tokens, ns)
        assert m.num_tokens == self.ref.match(tokens, ns) == len(m.slots)
        self.cache.inc_lock_ref(m.last_node)
        self.ref.lock(tokens, ns, m.num_tokens, +1)
        return m.slots, m.last_node, m.num_tokens

    def make_room(self, slots: list[int], new_len: int) -> bool:
        need = self.allocator.num_new_pages(slots, new_len) - self.allocator.num_free_pages
        if need > 0:
            assert self.cache.evict(need * self.ps) == self.ref.evict(need * self.ps)
        return self.allocator.can_extend(slots, new_len)

    def start(self, tokens: list[int], ns: str, whole: bool) -> None:
        query = tokens if whole else tokens[:-1]
        slots, node, n = self.match_and_lock(query, ns)
        if not self.make_room(slots, len(tokens)):
            self.cache.dec_lock_ref(node)
            self.ref.lock(query, ns, n, -1)
            return
        self.allocator.extend(slots, len(tokens))
        self.running.append(_Req(list(tokens), ns, slots, node, n))

    def grow(self, i: int, extra: list[int]) -> None:
        r = self.running[i % len(self.running)]
        if self.make_room(r.slots, len(r.slots) + len(extra)):
            self.allocator.extend(r.slots, len(r.slots) + len(extra))
            r.tokens += extra

    def finish(self, i: int) -> None:
        r = self.running.pop(i % len(self.running))
        self.cache.cache_finished(r.tokens, r.slots, r.node, r.ns)
        self.ref.insert(r.tokens, r.ns)
        self.ref.lock(r.tokens, r.ns, r.num_locked, -1)

    def unfinished(self, i: int) -> None:
        r = self.running[i % len(self.running)]
        m = self.cache.cache_unfinished(r.tokens, r.slots, r.node, r.ns)
        assert m.num_tokens == len(m.slots) == len(r.tokens)
        self.ref.insert(r.tokens, r.ns)
        aligned = len(r.tokens) - len(r.tokens) % self.ps
        self.ref.lock(r.tokens, r.ns, aligned, +1)
        self.ref.lock(r.tokens, r.ns, r.num_locked, -1)
        r.slots, r.node, r.num_locked = m.slots, m.last_node, aligned

    def read(self, tokens: list[int], ns: str) -> None:
        _, node, n = self.match_and_lock(tokens, ns)
        self.readers.append((tokens, ns, n, node))

    def release(self, i: int) -> None:
        tokens, ns, n, node = self.readers.pop(i % len(self.readers))
        self.cache.dec_lock_ref(node)
        self.ref.lock(tokens, ns, n, -1)

    def evict(self, num_tokens: int) -> None:
        assert self.cache.evict(num_tokens) == self.ref.evict(num_tokens)

    def check(self) -> None:
        cache, ref = self.cache, self.ref
        _check(cache, [(r.slots, r.node) for r in self.running])
        assert cache.num_cached_tokens == ref.num_cached
        assert cache.num_protected_tokens == ref.num_protected
        assert cache.num_evictable_tokens == ref.num_cached - ref.num_protected
        own_pages = sum(
            self.allocator.num_pages_for(len(r.slots) - r.num_locked) for r in self.running
        )
        expected_free = self.allocator.num_pages - ref.num_cached // self.ps - own_pages
        assert self.allocator.num_free_pages == expected_free

    def drain(self) -> None:
        while self.running:
            self.finish(0)
        while self.readers:
            self.release(0)
        self.check()
        assert self.cache.num_protected_tokens == 0
        assert self.cache.evict(10**9) == self.ref.evict(10**9)
        assert self.allocator.num_free_pages == self.allocator.num_pages


# tenants "" (both), "ka" (both of its namespaces, weight 1) and "kb" (weight 2)
_TENANT_NAMESPACES = ["", "lora-1", "ka", "ka/s1", "kb"]
_SHARES = TenantShares({"kb": 2.0})


def _drive(
    data: st.DataObject, page_size: int, num_pages: int, shares: TenantShares | None = None
) -> None:
    d = _Driver(page_size, num_pages, shares)
    tokens = _tokens(page_size)
    namespaces = st.sampled_from(["", "lora-1"] if shares is None else _TENANT_NAMESPACES)
    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        ops = ["start", "read", "evict"]
        if d.running:
            ops += ["finish", "unfinished", "grow"]
        if d.readers:
            ops += ["release"]
        op = data.draw(st.sampled_from(ops), label="op")
        if op == "start":
            d.start(data.draw(tokens), data.draw(namespaces), data.draw(st.booleans()))
        elif op == "read":
            d.read(data.draw(tokens), data.draw(namespaces))
        elif op == "evict":
            d.evict(data.draw(st.integers(0, 6 * page_size)))
        elif op == "finish":
            d.finish(data.draw(st.integers(0, 99)))
        elif op == "unfinished":
            d.unfinished(data.draw(st.integers(0, 99)))
        elif op == "grow":
            extra = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=2 * page_size))
            d.grow(data.draw(st.integers(0, 99)), extra)
        else:
            d.release(data.draw(st.integers(0, 99)))
        d.check()
    d.drain()


_PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.timeout(60)
@_PROPERTY
@given(data=st.data())
def test_property_page_size_1(data: st.DataObject) -> None:
    _drive(data, page_size=1, num_pages=24)


@pytest.mark.timeout(60)
@_PROPERTY
@given(data=st.data())
def test_property_page_size_16(data: st.DataObject) -> None:
    _drive(data, page_size=16, num_pages=12)


@pytest.mark.timeout(60)
@_PROPERTY
@given(data=st.data())
def test_property_fair_eviction_page_size_1(data: st.DataObject) -> None:
    _drive(data, page_size=1, num_pages=24, shares=_SHARES)


@pytest.mark.timeout(60)
@_PROPERTY
@given(data=st.data())
def test_property_fair_eviction_page_size_16(data: st.DataObject) -> None:
    _drive(data, page_size=16, num_pages=12, shares=_SHARES)


@pytest.mark.parametrize("page_size", [1, 4])
def test_continuation_reads_what_followed_the_whole_text_without_touching_the_tree(page_size):
    cache, _ = _make_cache(page_size=page_size)
    _run(cache, list(range(100, 116)))  # cached: 100..115
    _run(cache, [100, 101, 102, 103, 7, 7, 7, 7])  # a branch after 4 tokens, used last
    tree = cache._tree
    nodes = {id(n): n.last_access for n in tree.iter_nodes()}
    assert cache.continuation([100, 101, 102, 103, 104, 105], "", 3) == [106, 107, 108]
    assert cache.continuation([100, 101, 102, 103, 104], "", 20) == list(range(105, 116))
    # at the branch: the most recently used child
    assert cache.continuation([100, 101, 102, 103], "", 2) == [7, 7]
    assert cache.continuation([100, 101, 9], "", 3) == []  # not held
    assert cache.continuation(list(range(100, 116)), "", 3) == []  # nothing follows
    assert cache.continuation([100, 101], "other", 3) == []  # another namespace
    assert cache.continuation([], "", 3) == []
    assert {id(n): n.last_access for n in tree.iter_nodes()} == nodes  # read-only
    assert NoPrefixCache(SlotAllocator(8)).continuation([1, 2], "", 3) == []
