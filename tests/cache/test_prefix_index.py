"""PrefixIndex: the coordinator's mirror answers like the RadixCache whose events it replays, one
node alone or many sharing a SharedPrefixIndex."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd.cache.holder_tree import encode_tokens
from pd.cache.prefix_index import PrefixIndex, SharedPrefixIndex
from pd.cache.radix_cache import RadixCache
from pd.core.kv_pool import SlotAllocator
from pd.core.messages import CacheEventMsg


def _make_cache(num_pages: int = 64, page_size: int = 1, node_id: str = "p0") -> RadixCache:
    return RadixCache(SlotAllocator(num_pages * page_size, page_size), node_id=node_id)


def _run(cache: RadixCache, tokens: list[int], namespace: str = "") -> None:
    m = cache.match_prefix(tokens, namespace)
    cache.inc_lock_ref(m.last_node)
    cache.make_room(cache.allocator.num_new_pages(m.slots, len(tokens)) * cache.page_size)
    slots = cache.allocator.extend(m.slots, len(tokens))
    cache.cache_finished(tokens, slots, m.last_node, namespace)


def _event(seq: int, kind: str, tokens: list[int], num_evicted: int = 0) -> CacheEventMsg:
    return CacheEventMsg(
        node_id="p0", seq=seq, kind=kind, namespace="", tokens=tokens, num_evicted=num_evicted
    )


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
    assert index.next_seq == cache.events.next_seq and not index.needs_resync


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
        index.apply(CacheEventMsg(node_id="p1", seq=0, kind="inserted", namespace="", tokens=[1]))
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


# -- several nodes in one SharedPrefixIndex ----------------------------------------------------


def _rebuilt(caches: dict[str, RadixCache], page_size: int) -> SharedPrefixIndex:
    """A fresh shared index from every cache's snapshot (drops the caches' pending events)."""
    shared = SharedPrefixIndex(page_size)
    for node_id, cache in caches.items():
        shared.add(node_id).apply_snapshot(cache.take_snapshot())
    return shared


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("page_size", [1, 4])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_shared_index_matches_every_cache(page_size: int, data: st.DataObject) -> None:
    """Three nodes' caches replayed into one tree, with prompts in flight on them: each node's
    view answers as its cache does, the walk answers for all at once, and the tree has the same
    shape as one rebuilt from the caches' snapshots."""
    names = ["p0", "p1", "p2"]
    caches = {n: RadixCache(SlotAllocator(12 * page_size, page_size), n) for n in names}
    shared = SharedPrefixIndex(page_size)
    indexes = {n: shared.add(n) for n in names}
    pending: list[tuple[str, list[int], str]] = []
    seen: list[tuple[list[int], str]] = []
    for _ in range(data.draw(st.integers(1, 25), label="steps")):
        node = data.draw(st.sampled_from(names))
        tokens, ns = data.draw(_tokens(page_size)), data.draw(st.sampled_from(["", "t1"]))
        action = data.draw(st.sampled_from(["run", "run", "evict", "pend", "pend", "unpend"]))
        if action == "run":
            _run(caches[node], tokens, ns)
        elif action == "evict":
            caches[node].evict(data.draw(st.integers(1, 6)) * page_size)
        elif action == "pend":
            pending.append((node, tokens, ns))
            key = encode_tokens(tokens)
            # Reusing the walk of the prompt less its last token, as route does (or a stale one).
            after = shared.match(key[:-4], ns) if data.draw(st.booleans()) else None
            if after is not None and data.draw(st.booleans()):
                shared.add_pending(node, key, ns)  # changes the tree: ``after`` is now stale
                pending.append((node, tokens, ns))
            shared.add_pending(node, key, ns, after=after)
        elif pending:
            gone = pending.pop(data.draw(st.integers(0, len(pending) - 1)))
            shared.remove_pending(gone[0], encode_tokens(gone[1]), gone[2])
        for n in names:
            for e in caches[n].take_events():
                assert shared.apply(e)
        seen.append((tokens, ns))
        for q, q_ns in seen[-6:]:
            match = shared.match(encode_tokens(q), q_ns)
            for n in names:
                held = caches[n].match_prefix(q, q_ns).num_tokens
                bit = indexes[n].bit
                assert indexes[n].match_len(q, q_ns) == match.held_len(bit) == held
                in_flight = [
                    _common_prefix(q, t) for m, t, t_ns in pending if (m, t_ns) == (n, q_ns)
                ]
                expected = max([held] + [c - c % page_size for c in in_flight])
                assert match.expected_len(bit) == expected
            lengths = {indexes[n].bit: match.expected_len(indexes[n].bit) for n in names}
            top = max(lengths.values())
            longest = sum(b for b, v in lengths.items() if v == top) if top else 0
            assert match.longest_expected(sum(lengths)) == (longest, top)
        for n in names:
            assert indexes[n].num_cached_tokens == caches[n].num_cached_tokens
        shared.check_integrity((n, encode_tokens(t), t_ns) for n, t, t_ns in pending)
    for node, tokens, ns in pending:
        shared.remove_pending(node, encode_tokens(tokens), ns)
    assert sorted(shared.tree.iter_edges()) == sorted(_rebuilt(caches, page_size).tree.iter_edges())


@pytest.mark.timeout(10)
def test_a_gap_on_one_node_is_repaired_by_its_snapshot() -> None:
    caches = {n: _make_cache(page_size=2, node_id=n) for n in ("p0", "p1")}
    shared = SharedPrefixIndex(page_size=2)
    for n in caches:
        shared.add(n)
    _run(caches["p0"], [1, 1, 2, 2])
    _run(caches["p1"], [1, 1, 3, 3])
    for cache in caches.values():
        assert all(shared.apply(e) for e in cache.take_events())
    _run(caches["p0"], [1, 1, 4, 4])
    caches["p0"].take_events()  # lost on the way
    _run(caches["p0"], [5, 5])
    assert [shared.apply(e) for e in caches["p0"].take_events()] == [False]
    assert shared.nodes_to_resync == ["p0"]
    index = shared.index("p0")
    assert index.match_len([5, 5, 0]) == 0 and index.match_len([1, 1, 2, 2]) == 4  # last good
    assert shared.index("p1").match_len([1, 1, 3, 3]) == 4  # the other node is unaffected
    with pytest.raises(ValueError, match="starts with a reset event, got inserted"):
        index.apply_snapshot([_event(9, "inserted", [7, 7])])
    index.apply_snapshot(caches["p0"].take_snapshot())
    assert shared.nodes_to_resync == []
    _run(caches["p0"], [5, 5, 6, 6])  # later events apply in step again
    assert all(shared.apply(e) for e in caches["p0"].take_events())
    for q in ([1, 1, 2, 2], [1, 1, 3, 3], [1, 1, 4, 4], [5, 5, 6, 6, 0]):
        for n, cache in caches.items():
            assert shared.index(n).match_len(q) == cache.match_prefix(q).num_tokens
    assert index.num_cached_tokens == caches["p0"].num_cached_tokens == 10
    assert sorted(shared.tree.iter_edges()) == sorted(_rebuilt(caches, 2).tree.iter_edges())


@pytest.mark.timeout(10)
def test_removed_node_leaves_the_tree_and_its_bit_is_reused() -> None:
    shared = SharedPrefixIndex(page_size=1)
    p0, p1 = shared.add("p0"), shared.add("p1")
    p0.apply(CacheEventMsg(node_id="p0", seq=0, kind="inserted", namespace="", tokens=[1, 2]))
    p1.apply(CacheEventMsg(node_id="p1", seq=0, kind="inserted", namespace="", tokens=[1, 2, 3]))
    shared.add_pending("p0", encode_tokens([1, 2, 3, 4]))
    shared.remove("p0")
    shared.remove_pending("p0", encode_tokens([1, 2, 3, 4]))  # gone with the node: no-op
    assert p0.match_len([1, 2]) == 0 and "p0" not in shared
    match = shared.match(encode_tokens([1, 2, 3]))
    assert (match.expected_len(p0.bit), match.expected_len(p1.bit)) == (0, 3)
    assert match.longest_expected(p0.bit | p1.bit) == (p1.bit, 3)
    p2 = shared.add("p2")
    assert p2.bit == 1  # p0's, free again
    assert p2.match_len([1, 2]) == 0 and shared.index("p1").match_len([1, 2, 3]) == 3
    shared.check_integrity()
    with pytest.raises(ValueError, match="already indexed"):
        shared.add("p1")
