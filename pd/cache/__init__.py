"""Prefix caching (layer 3, above ``pd.core`` and ``pd.model``): the radix tree, the KV ``RadixCache`` every node and the colocated engine use,
the host and disk tiers below it (``HostTier``, ``DiskTier``), the cache-off ``NoPrefixCache``, the ``BasePrefixCache`` seam between them and the scheduler, and
the coordinator's ``PrefixIndex`` (a mirror of a node's tree rebuilt from its cache events)."""

from __future__ import annotations

from pd.cache.base import BasePrefixCache, MatchResult, NoPrefixCache
from pd.cache.disk_tier import DiskStats, DiskTier
from pd.cache.host_tier import BaseKVMover, HostTier, TierStats
from pd.cache.prefix_index import PrefixIndex
from pd.cache.radix_cache import RadixCache
from pd.cache.tenants import TenantShares
from pd.core.kv_pool import SlotAllocator


def make_prefix_cache(
    enabled: bool,
    allocator: SlotAllocator,
    node_id: str,
    host: BaseKVMover | None = None,
    disk: DiskTier | None = None,
    shares: TenantShares | None = None,
) -> BasePrefixCache:
    """The one way every engine and node gets its cache: a RadixCache (over a host tier when
    ``host`` moves KV to one, and a disk tier below that), or none when disabled; both tiers
    evict fairly between tenants with ``shares``, by global LRU without."""
    if not enabled:
        return NoPrefixCache(allocator)
    lower = None if host is None else HostTier(host, allocator.page_size, disk, shares)
    return RadixCache(allocator, node_id, lower=lower, shares=shares)


__all__ = [
    "BaseKVMover",
    "BasePrefixCache",
    "DiskStats",
    "DiskTier",
    "HostTier",
    "MatchResult",
    "NoPrefixCache",
    "PrefixIndex",
    "RadixCache",
    "TenantShares",
    "TierStats",
    "make_prefix_cache",
]
