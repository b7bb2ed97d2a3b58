"""The prefix-cache seam: what the engine asks of a KV prefix cache, and the cache-off version.

The life of a request's slots against a cache (``n`` prompt tokens, page size ``ps``):

1. ``m = cache.match_prompt(prompt, ns)`` (= ``match_prefix(prompt[:-1])``: the last prompt
   token is always computed, so there are logits to sample from), then
   ``cache.inc_lock_ref(m.last_node)``. The slots ``m.slots`` belong to the cache.
2. Make room and take the rest: ``cache.make_room(allocator.num_new_pages(m.slots, n) * ps)``,
   then ``slots = allocator.extend(m.slots, n)`` (raises OutOfSlotsError if still no room).
   Written out, the pattern is ``if not allocator.can_allocate(k): cache.evict(k - free)``.
3. Compute ``prompt[m.num_tokens:]`` into ``slots[m.num_tokens:]``.
4. Either keep running: ``m = cache.cache_unfinished(tokens, slots, m.last_node, ns)`` hands
   the aligned prompt to the cache and returns the slot list to use from now on, with the lock
   moved to ``m.last_node``; or finish: ``cache.cache_finished(tokens, slots, m.last_node, ns)``
   takes every slot, and the request owns nothing afterwards.

Throughout, ``slots`` holds exactly one slot per token, and a request owns outright only the
slots after the path of the node it has locked (``check_slot_ownership`` verifies that).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from pd.cache.host_tier import HostTier, TierStats
from pd.core.kv_pool import SlotAllocator
from pd.core.messages import CacheEventMsg

# A cache's node handle: opaque to callers, who only keep it and pass it back.
NodeHandle = Any


class MatchResult(NamedTuple):
    slots: list[int]  # slots of the matched prefix (a fresh list the caller may extend)
    last_node: NodeHandle  # the node to lock / hand back; its path is the matched prefix
    num_tokens: int  # == len(slots)


class CacheStats(NamedTuple):
    num_hit_tokens: int  # tokens matched, over all match_prefix calls
    num_miss_tokens: int  # tokens asked for but not matched
    num_evicted_tokens: int

    @property
    def hit_rate(self) -> float:
        total = self.num_hit_tokens + self.num_miss_tokens
        return self.num_hit_tokens / total if total else 0.0


class BasePrefixCache(ABC):
    """A KV prefix cache over a SlotAllocator; all counts are in tokens (slots)."""

    allocator: SlotAllocator
    page_size: int
    lower: HostTier | None = None  # the host tier below the pool, if any

    @abstractmethod
    def match_prefix(self, tokens: Sequence[int], namespace: str = "") -> MatchResult:
        """Longest cached prefix of ``tokens`` in ``namespace``, a multiple of page_size tokens.

        Updates the LRU time of the matched path. Does not lock: the caller locks
        ``last_node`` before anything can evict. Whole-prompt hits are the caller's concern:
        match ``prompt[:-1]`` (see ``match_prompt``) so at least one token is computed.
        """

    def continuation(self, tokens: Sequence[int], namespace: str, k: int) -> list[int]:
        """Up to ``k`` cached tokens that followed all of ``tokens`` before (a draft for
        speculative decoding); [] without a cache or such a path."""
        return []

    def match_for_peer(self, tokens: Sequence[int], namespace: str = "") -> MatchResult:
        """``match_prefix`` for another node's pull (or a pull into this cache): the same
        match, not counted as this node's hit or miss. Without a cache, nothing matches."""
        return MatchResult([], None, 0)

    @abstractmethod
    def inc_lock_ref(self, node: NodeHandle) -> None:
        """Lock the path root..node: locked nodes are never evicted."""

    @abstractmethod
    def dec_lock_ref(self, node: NodeHandle) -> None:
        """Undo one ``inc_lock_ref(node)``; the path becomes evictable when no lock is left."""

    @abstractmethod
    def cache_finished(
        self,
        tokens: Sequence[int],
        slots: Sequence[int],
        last_node: NodeHandle,
        namespace: str = "",
    ) -> None:
        """Take every slot of a finished request (``len(slots) == len(tokens)``).

        Caches the page-aligned part of ``tokens``; where those positions are already cached
        under other slots, the request's duplicate pages are freed, as is the unaligned tail.
        Then ``dec_lock_ref(last_node)``. The request owns nothing afterwards.
        """

    @abstractmethod
    def cache_unfinished(
        self,
        tokens: Sequence[int],
        slots: Sequence[int],
        last_node: NodeHandle,
        namespace: str = "",
    ) -> MatchResult:
        """Cache a running request's tokens so far (``len(slots) == len(tokens)``) and keep it.

        Inserts and frees duplicates like ``cache_finished``, moves the lock from ``last_node``
        to the returned node, and returns the slots the request must use from now on: the
        cache's slots for the cached part, the request's own for the unaligned tail.
        """

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` (whole pages) from unlocked leaves, least recently
        used first, leaf upward, if that many are evictable; returns the tokens freed. A cache
        that evicts fairly takes each leaf from the tenant most over its share of the pool
        (``pd.cache.tenants``), in that tenant's own least-recently-used order."""

    @property
    @abstractmethod
    def num_cached_tokens(self) -> int:
        """Tokens held by the cache (== evictable + protected)."""

    @property
    @abstractmethod
    def num_evictable_tokens(self) -> int:
        """Cached tokens on no locked path: what ``evict`` could free right now."""

    @property
    @abstractmethod
    def num_protected_tokens(self) -> int:
        """Cached tokens on a locked path."""

    @property
    @abstractmethod
    def stats(self) -> CacheStats:
        """Hit / miss / evicted token counters since construction."""

    @abstractmethod
    def take_events(self) -> list[CacheEventMsg]:
        """Drain the cache events (inserted / evicted) not taken yet, oldest first."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Assert the cache's own invariants (counts, lock refs, unique slots, shape)."""

    @abstractmethod
    def check_slot_ownership(self, running: Iterable[tuple[Sequence[int], NodeHandle]]) -> None:
        """Every slot is free, in the cache, or owned by one running request, exactly once.

        ``running`` holds each running request's full slot list and the node it has locked;
        the request must share the cache's slots along that node's path and own the rest.
        """

    @property
    def tier_stats(self) -> TierStats | None:
        """The counters of the tier below the pool, or None without one."""
        return None if self.lower is None else self.lower.stats

    def note_prefill(self, num_tokens: int, seconds: float) -> None:
        """The engine computed ``num_tokens`` of prompts in ``seconds``: the speed a load from
        the tier below must beat (without one, nothing to do)."""
        if self.lower is not None:
            self.lower.prefill_rate.add(num_tokens, seconds)

    def match_prompt(self, prompt: Sequence[int], namespace: str = "") -> MatchResult:
        """``match_prefix(prompt[:-1])``: a fully cached prompt still computes its last token."""
        return self.match_prefix(prompt[:-1], namespace)

    def make_room(self, num_slots: int) -> bool:
        """Evict until ``num_slots`` slots (whole pages) are free; True if they are."""
        missing = self.allocator.num_pages_for(num_slots) * self.page_size
        missing -= self.allocator.num_free_slots
        if missing > 0:
            self.evict(missing)
        return self.allocator.can_allocate(num_slots)


class NoPrefixCache(BasePrefixCache):
    """The cache turned off: matches nothing, and every finished request frees its slots."""

    def __init__(self, allocator: SlotAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self._num_miss = 0

    def match_prefix(self, tokens: Sequence[int], namespace: str = "") -> MatchResult:
        self._num_miss += len(tokens)
        return MatchResult([], None, 0)

    def inc_lock_ref(self, node: NodeHandle) -> None:
        assert node is None, f"NoPrefixCache has no nodes, got {node!r}"

    def dec_lock_ref(self, node: NodeHandle) -> None:
        assert node is None, f"NoPrefixCache has no nodes, got {node!r}"

    def cache_finished(
        self,
        tokens: Sequence[int],
        slots: Sequence[int],
        last_node: NodeHandle,
        namespace: str = "",
    ) -> None:
        check_slot_count(tokens, slots)
        self.dec_lock_ref(last_node)
        self.allocator.free(slots)

    def cache_unfinished(
        self,
        tokens: Sequence[int],
        slots: Sequence[int],
        last_node: NodeHandle,
        namespace: str = "",
    ) -> MatchResult:
        check_slot_count(tokens, slots)
        self.dec_lock_ref(last_node)
        return MatchResult(list(slots), None, len(slots))

    def evict(self, num_tokens: int) -> int:
        return 0

    @property
    def num_cached_tokens(self) -> int:
        return 0

    @property
    def num_evictable_tokens(self) -> int:
        return 0

    @property
    def num_protected_tokens(self) -> int:
        return 0

    @property
    def stats(self) -> CacheStats:
        return CacheStats(0, self._num_miss, 0)

    def take_events(self) -> list[CacheEventMsg]:
        return []

    def check_integrity(self) -> None:
        pass  # nothing cached, nothing to be inconsistent

    def check_slot_ownership(self, running: Iterable[tuple[Sequence[int], NodeHandle]]) -> None:
        owned = []
        for slots, node in running:
            assert node is None, f"NoPrefixCache has no nodes, got {node!r}"
            owned.append(slots)
        self.allocator.check_integrity(owned)


def check_slot_count(tokens: Sequence[int], slots: Sequence[int]) -> None:
    """A request hands its slots to a cache with exactly one slot per token."""
    if len(slots) != len(tokens):
        raise ValueError(
            f"a request hands over one slot per token: {len(tokens)} tokens, {len(slots)} slots"
        )
