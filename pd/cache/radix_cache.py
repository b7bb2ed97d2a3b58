"""RadixCache: a node's KV prefix cache, a RadixTree whose values are slot indices.

A node's key is whole pages of tokens and its value is the slots holding their KV, so a node
owns whole allocator pages and evicting it frees exactly those. Locks cover the path
root..node; eviction takes unlocked leaves, least recently used first, trimming a leaf from its
end by pages when less than the whole leaf is needed; with ``shares`` (fair eviction,
``pd.cache.tenants``) each leaf is the own least recent of the tenant most over its share.
Every insertion and eviction becomes a CacheEventMsg that the coordinator's PrefixIndex
replays (``pd.cache.cache_events``). The request-side protocol is in ``pd.cache.base``.

With a host tier below (``lower``, ``pd.cache.host_tier``), an evicted leaf's path is saved
down before its slots are freed, and a match that ends on the device continues there (and on
disk) and loads back what pays; the events then describe what the node holds in either tier:
an eviction the host keeps emits nothing, and the host's drops emit what neither holds.

Counts (tokens): num_cached = num_evictable + num_protected; protected = on a locked path.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pd.cache.base import (
    BasePrefixCache,
    CacheStats,
    MatchResult,
    NodeHandle,
    check_slot_count,
)
from pd.cache.cache_events import CacheEvents
from pd.cache.host_tier import HostTier
from pd.cache.radix_tree import RadixNode, RadixTree, TreeInsert
from pd.cache.tenants import TenantShares
from pd.core.kv_pool import SlotAllocator
from pd.core.messages import CacheEventMsg


class RadixCache(BasePrefixCache):
    """Token-level (page-granular) prefix cache over ``allocator``'s slots."""

    def __init__(
        self,
        allocator: SlotAllocator,
        node_id: str = "",
        *,
        max_pending_events: int = 65536,
        lower: HostTier | None = None,
        shares: TenantShares | None = None,
    ) -> None:
        self.allocator = allocator
        self.shares = shares  # fair eviction between tenants (None: global LRU)
        self.lower = lower  # the host tier below the device pool, if any
        self.page_size = allocator.page_size
        self._tree = RadixTree(self.page_size)
        self._num_cached = 0
        self._num_protected = 0
        self._num_hit = 0
        self._num_miss = 0
        self._num_evicted = 0
        trees = [self._tree] if lower is None else [self._tree, lower.tree]
        self.events = CacheEvents(node_id, trees, max_pending_events)
        if lower is not None:  # what the disk holds from before this node: announced
            for namespace, path in lower.warm_up():
                self.events.emit("inserted", namespace, path)

    # -- matching and locking ---------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int], namespace: str = "") -> MatchResult:
        match = self.match_for_peer(tokens, namespace)
        self._num_hit += match.num_tokens
        self._num_miss += len(tokens) - match.num_tokens
        return match

    def continuation(self, tokens: Sequence[int], namespace: str, k: int) -> list[int]:
        return self._tree.continuation(tokens, namespace, k)

    def match_for_peer(self, tokens: Sequence[int], namespace: str = "") -> MatchResult:
        m = self._tree.match(tokens, namespace)
        match = MatchResult(m.values, m.node, m.num_tokens)
        if self.lower is not None and len(tokens) - m.num_tokens >= self.page_size:
            match = self._load_back(tokens, namespace, match)
        if self.lower is not None and match.num_tokens:  # a reused prefix: written through
            self.lower.write_through(tokens[: match.num_tokens], match.slots, namespace)
        return match

    def _load_back(self, tokens: Sequence[int], namespace: str, m: MatchResult) -> MatchResult:
        """Extend the device match ``m`` with what the host tier, then the disk, hold beyond
        it, when loading beats computing and the device pool has room (evicting what is
        unlocked)."""
        assert self.lower is not None
        below = self.lower.match_below(tokens, namespace, m.num_tokens)
        h = below.host
        num_host = max(0, h.num_tokens - m.num_tokens)
        num_load = below.num_tokens - m.num_tokens
        if num_load <= 0 or not self.lower.pays(num_host, num_load - num_host):
            return m
        if below.refs:  # loading pays: only now are the disk's bytes read
            below = self.lower.read_below(below, tokens, namespace)
            num_load = below.num_tokens - m.num_tokens
            if num_load <= 0:
                return m
        self.inc_lock_ref(m.last_node)
        self.lower.lock(h)  # making room saves evicted paths into the tier: never over h
        try:
            if not self.make_room(num_load):
                return m
            slots = self.allocator.allocate(num_load)
            if num_host:
                self.lower.load(h, m.num_tokens, slots[:num_host])
            if num_load > num_host:
                self.lower.load_chunks(below, m.num_tokens + num_host, slots[num_host:])
            end = below.num_tokens
            ins = self._insert(tokens[:end], m.slots + slots, m.last_node, namespace)
        finally:
            self.lower.unlock(h)
            self.dec_lock_ref(m.last_node)
        return MatchResult(m.slots + slots, ins.node, end)

    def inc_lock_ref(self, node: NodeHandle) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self._num_protected += len(node.key)
            node.lock_ref += 1
            node = node.parent
        assert node.is_root, f"lock on a node that is no longer in the tree: {node}"

    def dec_lock_ref(self, node: NodeHandle) -> None:
        while node.parent is not None:
            assert node.lock_ref > 0, f"unlock of an unlocked node {node}"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._num_protected -= len(node.key)
            node = node.parent
        assert node.is_root, f"unlock of a node that is no longer in the tree: {node}"

    # -- handing slots over -----------------------------------------------------------------

    def cache_finished(
        self,
        tokens: Sequence[int],
        slots: Sequence[int],
        last_node: NodeHandle,
        namespace: str = "",
    ) -> None:
        check_slot_count(tokens, slots)
        aligned = len(tokens) - len(tokens) % self.page_size
        self._insert(tokens[:aligned], slots[:aligned], last_node, namespace)
        if aligned < len(slots):
            self.allocator.free(slots[aligned:])
        self.dec_lock_ref(last_node)

    def cache_unfinished(
        self,
        tokens: Sequence[int],
        slots: Sequence[int],
        last_node: NodeHandle,
        namespace: str = "",
    ) -> MatchResult:
        check_slot_count(tokens, slots)
        aligned = len(tokens) - len(tokens) % self.page_size
        ins = self._insert(tokens[:aligned], slots[:aligned], last_node, namespace)
        new_slots = ins.existing_values
        new_slots.extend(slots[ins.num_existing :])
        self.inc_lock_ref(ins.node)
        self.dec_lock_ref(last_node)
        return MatchResult(new_slots, ins.node, len(new_slots))

    def _insert(
        self, tokens: Sequence[int], slots: Sequence[int], last_node: RadixNode, namespace: str
    ) -> TreeInsert:
        """Insert an aligned path; free the request's pages that duplicate cached ones."""
        ins = self._tree.insert(tokens, slots, namespace)
        locked = self._tree.path_values(last_node)
        assert ins.num_existing >= len(locked) and list(slots[: len(locked)]) == locked, (
            f"request does not hold the {len(locked)} slots of its locked path "
            f"({ins.num_existing} tokens of it cached)"
        )
        # Pages after the locked path that another request cached first: keep the cache's.
        ps = self.page_size
        existing = ins.existing_values
        duplicates = [
            s
            for i in range(len(locked), ins.num_existing, ps)
            if slots[i] != existing[i]
            for s in slots[i : i + ps]
        ]
        if duplicates:
            self.allocator.free(duplicates)
        num_new = len(tokens) - ins.num_existing
        if num_new:
            self._num_cached += num_new
            self.events.emit("inserted", namespace, list(tokens))
        return ins

    # -- eviction ---------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        freed = 0
        for node, take in self._tree.evict_order(num_tokens, self.shares):
            path = self._tree.path_tokens(node)
            held = len(path) - take  # tokens of the path this node still holds afterwards
            if self.lower is not None:  # saved down, before its slots are freed
                values = self._tree.path_values(node)
                held_below, dropped = self.lower.save(path, values, node.namespace)
                self.events.dropped_below(dropped)
                held = max(held, held_below)
            self.allocator.free(self._tree.trim_leaf(node, take))
            freed += take
            if held < len(path):
                self.events.emit("evicted", node.namespace, path, len(path) - held)
        self._num_cached -= freed
        self._num_evicted += freed
        return freed

    # -- counters and events ----------------------------------------------------------------

    @property
    def num_cached_tokens(self) -> int:
        return self._num_cached

    @property
    def num_evictable_tokens(self) -> int:
        return self._num_cached - self._num_protected

    @property
    def num_protected_tokens(self) -> int:
        return self._num_protected

    @property
    def stats(self) -> CacheStats:
        return CacheStats(self._num_hit, self._num_miss, self._num_evicted)

    def take_events(self) -> list[CacheEventMsg]:
        return self.events.take()

    def take_snapshot(self) -> list[CacheEventMsg]:
        """A ``reset`` then one ``inserted`` per leaf path: the whole cache, in either tier, as
        events (``CacheEvents.snapshot``: the pending events are dropped)."""
        return self.events.snapshot()

    # -- checks -----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        self._tree.check_integrity()
        ps = self.page_size
        num_cached = num_protected = 0
        seen: set[int] = set()
        for node in self._tree.iter_nodes():
            value = node.value
            assert value is not None, f"cache node without slots {node}"
            num_cached += len(node.key)
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), (
                f"lock_ref {node.lock_ref} below its children's"
            )
            if node.lock_ref:
                num_protected += len(node.key)
            for i in range(0, len(value), ps):
                page = value[i : i + ps]
                assert page == list(range(page[0], page[0] + ps)) and page[0] % ps == 0, (
                    f"slots {page} are not one allocator page"
                )
            seen.update(value)
            assert len(seen) == num_cached, f"a slot of {node} is cached twice"
        assert num_cached == self._num_cached, f"{num_cached} cached, counter {self._num_cached}"
        assert num_protected == self._num_protected, (
            f"{num_protected} protected, counter {self._num_protected}"
        )
        if self.lower is not None:
            self.lower.check_integrity()

    def check_slot_ownership(self, running: Iterable[tuple[Sequence[int], NodeHandle]]) -> None:
        owned: list[Sequence[int]] = [n.value for n in self._tree.iter_nodes() if n.value]
        for slots, node in running:
            assert node.is_root or node.lock_ref > 0, f"running request's node is unlocked {node}"
            shared = self._tree.path_values(node)
            assert list(slots[: len(shared)]) == shared, (
                f"running request does not share the {len(shared)} slots of its locked path"
            )
            owned.append(slots[len(shared) :])
        self.allocator.check_integrity(owned)
