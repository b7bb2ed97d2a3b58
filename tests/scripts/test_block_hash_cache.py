"""BlockHashCache (benchmark baseline): chained block hits, capacity and LRU eviction."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd.cache.radix_cache import RadixCache
from pd.core.kv_pool import SlotAllocator
from pdtools.block_hash_cache import BlockHashCache

BS = 4


def _block(a: int) -> list[int]:
    return [a] * BS


def _run(cache: BlockHashCache, tokens: list[int], namespace: str = "") -> int | None:
    """One request start to finish; returns its hit tokens, or None if it did not fit."""
    m = cache.match_prefix(tokens, namespace)
    blocks = cache.allocate(m, len(tokens))
    if blocks is None:
        return None
    cache.free(tokens, blocks, namespace)
    cache.check_integrity()
    return m.num_tokens


@pytest.mark.timeout(10)
def test_block_hits_only_when_the_whole_chain_matches() -> None:
    cache = BlockHashCache(capacity_tokens=64, block_size=BS)
    assert _run(cache, _block(1) + _block(2) + [7, 7]) == 0
    assert cache.num_cached_tokens == 8  # the partial block is not cached
    assert _run(cache, _block(1) + _block(2) + _block(3)) == 8
    assert _run(cache, _block(9) + _block(2)) == 0  # same block 2, different parent
    assert _run(cache, _block(1) + [2, 2, 2, 5]) == 4
    assert _run(cache, _block(1) + _block(2), namespace="t1") == 0
    assert cache.stats.num_hit_tokens == 12


@pytest.mark.timeout(10)
def test_least_recently_freed_blocks_are_evicted_tail_first() -> None:
    cache = BlockHashCache(capacity_tokens=4 * BS, block_size=BS)
    _run(cache, _block(1) + _block(2))  # frees 2 then 1
    _run(cache, _block(3) + _block(4))  # takes the 2 never-used blocks, frees 4 then 3
    _run(cache, _block(5))  # evicts the oldest free block: [1, 2]'s tail, block 2
    assert cache.stats.num_evicted_tokens == BS
    assert cache.match_prefix(_block(1) + _block(2)).num_tokens == BS
    assert cache.match_prefix(_block(3) + _block(4)).num_tokens == 2 * BS
    cache.check_integrity()


@pytest.mark.timeout(10)
def test_blocks_in_use_are_not_evicted() -> None:
    cache = BlockHashCache(capacity_tokens=3 * BS, block_size=BS)
    _run(cache, _block(1) + _block(2))
    m = cache.match_prefix(_block(1) + _block(2))
    held = cache.allocate(m, 3 * BS)  # reuses both cached blocks + one new
    assert held is not None and cache.num_free_blocks == 0
    assert cache.allocate(cache.match_prefix(_block(8)), BS) is None
    cache.free(_block(1) + _block(2) + _block(3), held)
    assert _run(cache, _block(8)) == 0  # now evicts the least recently freed: block 3
    assert cache.match_prefix(_block(1) + _block(2)).num_tokens == 2 * BS


@pytest.mark.timeout(60)
@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(
        st.lists(st.sampled_from([_block(0), _block(1), [0, 0, 0, 1]]), min_size=1, max_size=4),
        min_size=1,
        max_size=12,
    ),
    tail=st.integers(0, BS - 1),
)
def test_without_eviction_hits_equal_the_radix_cache_at_the_same_page(
    prompts: list[list[list[int]]], tail: int
) -> None:
    blocks = BlockHashCache(capacity_tokens=1024, block_size=BS)
    allocator = SlotAllocator(1024, page_size=BS)
    radix = RadixCache(allocator)
    for pages in prompts:
        tokens = [t for p in pages for t in p] + [5] * tail
        m = radix.match_prefix(tokens)
        radix.inc_lock_ref(m.last_node)
        radix.cache_finished(tokens, allocator.extend(m.slots, len(tokens)), m.last_node)
        assert _run(blocks, tokens) == m.num_tokens
    assert blocks.num_cached_tokens == radix.num_cached_tokens
