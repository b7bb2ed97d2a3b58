"""PrefixIndex: the coordinator's mirror answers like the RadixCache whose events it replays."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd.cache.prefix_index import PrefixIndex
from pd.cache.radix_cache import RadixCache
from pd.engine.kv_pool import SlotAllocator
from pd.messages import CacheEventMsg


def _make_cache(num_pages: int = 64, page_size: int = 1) -> RadixCache:
    return RadixCache(SlotAllocator(num_pages * page_size, page_size), node_id="p0")


def _run(cache: RadixCache, tokens: list[int], namespace: str = "") -> None:
    m = cache.match_prefix(tokens, namespace)
    cache.inc_lock_ref(m.last_node)
    cache.make_room(cache.allocator.num_new_pages(m.slots, len(tokens)) * cache.page_size)
    slots = cache.allocator.extend(m.slots, len(tokens))
    cache.cache_finished(tokens, slots, m.last_node, namespace)


def _event(seq: int, kind: str, tokens: list[int], num_evicted: int = 0) -> CacheEventMsg:
    return CacheEventMsg("p0", seq, kind, "", tokens, num_evicted)


@pytest.mark.timeout(10)
def test_replays_inserts_and_evictions() -> None:
    cache = _make_cache(page_size=2)
    index = PrefixIndex(page_size=2, node_id="p0")
    _run(cache, [1, 1, 2, 2, 3])
    _run(cache, [1, 1, 4, 4], namespace="t1")
    _run(cache, [1, 1, 5, 5])
    cache.evict(2)  # the [2, 2] page, least recent
    assert all(index.apply(e) for e in cache.take_events())
    assert index.match_len([1, 1, 2, 2, 3]) == 2
    assert index.match_len([1, 1, 5, 5, 0]) == 4
    assert index.match_len([1, 1, 4, 4]) == 2 and index.match_len([1, 1, 4, 4], "t1") == 4
    assert index.match_len([1, 1, 4, 4], "t2") == 0
    assert index.num_cached_tokens == cache.num_cached_tokens == 8
    assert index.next_seq == cache.next_seq and not index.needs_resync


@pytest.mark.timeout(10)
def test_gap_flags_resync_until_a_reset() -> None:
    index = PrefixIndex(page_size=1, node_id="p0")
    assert index.apply(_event(0, "inserted", [1, 2]))
    assert not index.apply(_event(0, "inserted", [1, 2]))  # duplicate delivery: ignored
    assert not index.apply(_event(2, "inserted", [7]))  # seq 1 was lost
    assert index.needs_resync
    assert not index.apply(_event(3, "inserted", [8]))  # still out of step
    assert index.match_len([1, 2]) == 2 and index.match_len([7]) == 0  # last good state
    assert index.apply(_event(10, "reset", []))
    assert not index.needs_resync and index.match_len([1, 2]) == 0
    assert index.apply(_event(11, "inserted", [9, 9]))
    assert index.match_len([9, 9, 9]) == 2 and index.next_seq == 12


@pytest.mark.timeout(10)
def test_inconsistent_events_raise() -> None:
    index = PrefixIndex(page_size=1, node_id="p0")
    with pytest.raises(ValueError, match="node 'p1'"):
        index.apply(CacheEventMsg("p1", 0, "inserted", "", [1]))
    index.apply(_event(0, "inserted", [1, 2, 3]))
    with pytest.raises(ValueError, match="holds 3 of it"):
        index.apply(_event(1, "evicted", [1, 2, 3, 4], 1))
    assert index.needs_resync
    index.apply(_event(5, "reset", []))
    index.apply(_event(6, "inserted", [1, 2, 3]))
    with pytest.raises(ValueError, match="and more below"):
        index.apply(_event(7, "evicted", [1, 2], 1))
    with pytest.raises(ValueError, match="kind 'moved'"):
        index.apply(_event(7, "moved", [1]))


@pytest.mark.timeout(10)
def test_late_consumer_catches_up_from_a_snapshot() -> None:
    cache = _make_cache()
    _run(cache, [1, 2, 3])
    _run(cache, [4, 5])
    cache.take_events()  # lost to this consumer
    index = PrefixIndex(page_size=1, node_id="p0")
    for e in cache.take_snapshot():
        index.apply(e)
    _run(cache, [1, 2, 9])
    for e in cache.take_events():
        assert index.apply(e)
    for q in ([1, 2, 3], [4, 5], [1, 2, 9, 9]):
        assert index.match_len(q) == cache.match_prefix(q).num_tokens
    assert index.num_cached_tokens == cache.num_cached_tokens == 6


@pytest.mark.timeout(10)
def test_overflowing_event_buffer_shows_as_a_gap() -> None:
    cache = RadixCache(SlotAllocator(64), node_id="p0", max_pending_events=2)
    index = PrefixIndex(page_size=1, node_id="p0")
    for t in range(4):
        _run(cache, [t])
    assert [index.apply(e) for e in cache.take_events()] == [False, False]
    assert index.needs_resync


def _tokens(page_size: int) -> st.SearchStrategy[list[int]]:
    page = st.sampled_from([[a] * page_size for a in range(3)] + [[0] * (page_size - 1) + [1]])
    return st.builds(
        lambda pages, tail: [t for p in pages for t in p] + [2] * tail,
        st.lists(page, min_size=1, max_size=5),
        st.integers(0, page_size - 1),
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("page_size", [1, 16])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_index_matches_cache(page_size: int, data: st.DataObject) -> None:
    cache = _make_cache(num_pages=16, page_size=page_size)
    index = PrefixIndex(page_size, node_id="p0")
    namespaces = st.sampled_from(["", "t1"])
    seen: list[tuple[list[int], str]] = []
    for _ in range(data.draw(st.integers(1, 30), label="steps")):
        tokens, ns = data.draw(_tokens(page_size)), data.draw(namespaces)
        if data.draw(st.booleans(), label="evict"):
            cache.evict(data.draw(st.integers(1, 6)) * page_size)
        else:
            _run(cache, tokens, ns)
        for e in cache.take_events():
            assert index.apply(e)
        seen.append((tokens, ns))
        for q, q_ns in seen[-8:]:
            assert index.match_len(q, q_ns) == cache.match_prefix(q, q_ns).num_tokens
        assert index.num_cached_tokens == cache.num_cached_tokens
    cache.check_integrity()
