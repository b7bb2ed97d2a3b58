"""Prefix caching (layer 3, above ``pd.core`` and ``pd.model``): the radix tree, the KV ``RadixCache`` every node and the colocated engine use,
the cache-off ``NoPrefixCache``, the ``BasePrefixCache`` seam between them and the scheduler, and
the coordinator's ``PrefixIndex`` (a mirror of a node's tree rebuilt from its cache events)."""

from __future__ import annotations

from pd.cache.base import BasePrefixCache, MatchResult, NoPrefixCache
from pd.cache.prefix_index import PrefixIndex
from pd.cache.radix_cache import RadixCache
from pd.core.kv_pool import SlotAllocator


def make_prefix_cache(enabled: bool, allocator: SlotAllocator, node_id: str) -> BasePrefixCache:
    """The one way every engine and node gets its cache: a RadixCache, or none when disabled."""
    return RadixCache(allocator, node_id) if enabled else NoPrefixCache(allocator)


__all__ = [
    "BasePrefixCache",
    "MatchResult",
    "NoPrefixCache",
    "PrefixIndex",
    "RadixCache",
    "make_prefix_cache",
]
