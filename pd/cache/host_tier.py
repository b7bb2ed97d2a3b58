"""The host tier: a second, larger KV pool below a node's RadixCache, holding what the device
pool evicted, so that a prefix pushed out by other traffic is loaded back instead of computed.

On a GPU the host pool is host memory (copied through pinned buffers); on the CPU it is a
separate pool, so the device
pool's size (``--max-total-tokens``) keeps its meaning. The tier is plain Python: a RadixTree
whose values are host slots, a SlotAllocator over them, and a ``BaseKVMover`` (the engine's
torch side) that copies KV between the two pools.

The life of a prefix across the tiers:

1. The RadixCache evicts a leaf piece: before its device slots are freed, ``save(path, slots)``
   copies the whole path (root .. leaf end) into the tier, except the part the tier already
   holds (so each token is copied once, however often its path is evicted). The tier makes
   room by dropping its own least recently used leaves; those drops are returned, so the cache
   can tell the coordinator what the node no longer holds anywhere.
2. A request's match finds ``m`` tokens on the device and ``h > m`` here: when loading
   ``h - m`` tokens is faster than computing them (timed: this tier's copy bandwidth against
   the engine's prefill speed, ``pays``), the cache takes device slots for them, ``load``s
   them, and inserts the path, so the request sees an ``h``-token hit.

Paths here always start at a namespace's root, so tenants stay apart as on the device.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

from pd.cache.disk_tier import Chunk, ChunkRef, DiskStats, DiskTier
from pd.cache.radix_tree import RadixNode, RadixTree, TreeMatch
from pd.cache.tenants import TenantShares
from pd.core.kv_pool import SlotAllocator

_RATE_WEIGHT = 0.2  # weight of the newest measurement in a rate's moving average


class BaseKVMover(ABC):
    """Copies KV between the device pool and a host pool of ``num_slots`` slots (the engine's
    side of the tier; only it touches tensors)."""

    num_slots: int
    num_bytes_per_token: int

    @abstractmethod
    def save(self, device_slots: Sequence[int], host_slots: Sequence[int]) -> None:
        """Copy every layer's K and V of ``device_slots[i]`` into ``host_slots[i]``; returns
        when the copy is done (the device slots may be reused right after)."""

    @abstractmethod
    def load(self, host_slots: Sequence[int], device_slots: Sequence[int]) -> None:
        """Copy every layer's K and V of ``host_slots[i]`` into ``device_slots[i]``; returns
        when the device slots hold it."""

    @abstractmethod
    def host_bytes(self, host_slots: Sequence[int]) -> bytes:
        """Every layer's K and V of ``host_slots``, as bytes (a disk chunk's payload)."""

    @abstractmethod
    def device_bytes(self, device_slots: Sequence[int]) -> bytes:
        """The same for device slots (a hot prefix written through to disk)."""

    @abstractmethod
    def load_bytes(self, payload: memoryview, skip: int, device_slots: Sequence[int]) -> None:
        """Copy the KV of tokens ``skip ..`` of a ``host_bytes`` payload (a writable view, as a
        disk chunk's read gives it) into
        ``device_slots`` (one per token)."""

    @abstractmethod
    def store_bytes(self, payload: memoryview, skip: int, host_slots: Sequence[int]) -> None:
        """Copy the KV of tokens ``skip ..`` of a ``host_bytes`` payload into ``host_slots``
        (a disk chunk read up)."""


class Dropped(NamedTuple):
    """A piece the tier dropped to make room: the last ``num_tokens`` of ``path``."""

    namespace: str
    path: list[int]
    num_tokens: int


class BelowHost(NamedTuple):
    """What a match found past the device: in the host tier (``host``, up to its end) and on
    disk after it (``refs``: found by name; ``chunks``: read and checked, once ``read_below``
    ran, as far as they were intact)."""

    host: TreeMatch
    refs: list[ChunkRef]
    chunks: Sequence[Chunk] = ()
    read_seconds: float = 0.0  # reading and checking the chunks

    @property
    def num_tokens(self) -> int:
        return self.refs[-1].end if self.refs else self.host.num_tokens


class TierStats(NamedTuple):
    num_slots: int
    num_cached_tokens: int
    num_hit_tokens: int  # tokens loaded back for requests (hits served from this tier)
    num_loads: int
    num_load_bytes: int
    load_seconds: float
    num_skipped: int  # hits not loaded: computing them was timed faster
    num_saved_tokens: int
    num_dropped_tokens: int
    disk: DiskStats | None  # the disk tier below, if any


class Rate:
    """A moving average of a rate (units per second), None until its first sample."""

    def __init__(self) -> None:
        self.value: float | None = None

    def add(self, units: float, seconds: float) -> None:
        if units <= 0 or seconds <= 0:
            return
        rate = units / seconds
        self.value = (
            rate if self.value is None else ((1 - _RATE_WEIGHT) * self.value + _RATE_WEIGHT * rate)
        )


class HostTier:
    """KV evicted from a device pool, in a host pool of ``mover.num_slots`` slots."""

    def __init__(
        self,
        mover: BaseKVMover,
        page_size: int,
        disk: DiskTier | None = None,
        shares: TenantShares | None = None,
    ) -> None:
        if disk is not None and disk.chunk_tokens % page_size:
            raise ValueError(f"disk chunks of {disk.chunk_tokens} tokens, pages of {page_size}")
        self.mover = mover
        self.disk = disk
        self.page_size = page_size
        self.shares = shares  # fair eviction between tenants (None: global LRU)
        self.allocator = SlotAllocator(mover.num_slots, page_size)
        self.tree = RadixTree(page_size)  # values: host slots
        self._num_cached = 0
        self._num_hit = self._num_loads = self._num_load_bytes = self._num_skipped = 0
        self._num_saved = self._num_dropped = 0
        self._load_seconds = 0.0
        self.load_rate = Rate()  # bytes per second, host -> device
        self.disk_rate = Rate()  # bytes per second, disk -> device (read, checked, copied)
        self.prefill_rate = Rate()  # tokens per second the engine computes prompts at

    # -- down: what the device evicts ---------------------------------------------------------

    def save(
        self, tokens: Sequence[int], device_slots: Sequence[int], namespace: str
    ) -> tuple[int, list[Dropped]]:
        """Hold the page-aligned path ``tokens`` whose KV is in ``device_slots``, as far as
        room allows; returns how many leading tokens the tier holds now, and what it dropped."""
        assert len(tokens) == len(device_slots) and len(tokens) % self.page_size == 0
        m = self.tree.match(tokens, namespace)
        have = m.num_tokens
        if have == len(tokens):
            return have, []
        _lock(m.node, +1)
        try:
            dropped = self._make_room(len(tokens) - have)
            ps = self.page_size
            room = min(len(tokens) - have, self.allocator.num_free_slots // ps * ps)
            if room:
                host_slots = self.allocator.allocate(room)
                self.mover.save(device_slots[have : have + room], host_slots)
                self.tree.insert(tokens[: have + room], m.values + host_slots, namespace)
                self._num_cached += room
                self._num_saved += room
        finally:
            _lock(m.node, -1)
        return have + room, dropped

    def _make_room(self, num_tokens: int) -> list[Dropped]:
        missing = self.allocator.num_pages_for(num_tokens) * self.page_size
        missing -= self.allocator.num_free_slots
        dropped: list[Dropped] = []
        if missing <= 0:
            return dropped
        for node, take in self.tree.evict_order(missing, self.shares):
            path = self.tree.path_tokens(node)
            if self.disk is not None and self.disk.is_on:
                self._write_down(node, path, len(path) - take)
            dropped.append(Dropped(node.namespace, path, take))
            self.allocator.free(self.tree.trim_leaf(node, take))
            self._num_cached -= take
            self._num_dropped += take
        return dropped

    def _write_down(self, node: RadixNode, path: list[int], dropped_from: int) -> None:
        """Write the whole disk chunks of ``path`` that hold a token from ``dropped_from`` on
        (the rest of such a chunk is still here, on the path above ``node``)."""
        assert self.disk is not None
        values = self.tree.path_values(node)
        c = self.disk.chunk_tokens
        for end in self.disk.missing(node.namespace, path, (dropped_from // c + 1) * c):
            payload = self.mover.host_bytes(values[end - c : end])
            self.disk.write(node.namespace, path[:end], payload)

    def write_through(self, tokens: Sequence[int], device_slots: Sequence[int], ns: str) -> None:
        """A request reused ``tokens`` (held on the device in ``device_slots``): write their
        whole chunks to disk now, if they are not there, so that a node that dies leaves its
        hot prefixes to its replacement (evicted ones reach disk through this tier anyway)."""
        if self.disk is None or not self.disk.is_on:
            return
        c = self.disk.chunk_tokens
        for end in self.disk.missing(ns, tokens, c):
            payload = self.mover.device_bytes(device_slots[end - c : end])
            self.disk.write(ns, tokens[:end], payload)

    def warm_up(self) -> list[tuple[str, list[int]]]:
        """Read the disk's chains into this tier, most recently used first, while it has room
        (a node that starts on a host where others wrote chunks); returns the (namespace,
        path) of each chain now held here, as far as it was read."""
        if self.disk is None:
            return []
        held: list[tuple[str, list[int]]] = []
        c = self.disk.chunk_tokens
        for namespace, path in self.disk.scan():
            end = self.tree.held_len(path, namespace) // c * c
            while end < len(path) and self.allocator.can_allocate(c):
                chunk = self.disk.read(namespace, path[: end + c])
                if chunk is None:  # removed meanwhile, or damaged since the scan
                    break
                m = self.tree.match(chunk.path, namespace)
                slots = self.allocator.allocate(len(chunk.path) - m.num_tokens)
                # the chunk's first tokens may be here already (a path held in part)
                self.mover.store_bytes(chunk.payload, c - len(slots), slots)
                self.tree.insert(chunk.path, m.values + slots, namespace)
                self._num_cached += len(slots)
                end += c
            if end:
                held.append((namespace, path[:end]))
            if not self.allocator.can_allocate(c):
                break
        return held

    # -- up: what a request finds here ----------------------------------------------------------

    def match_below(self, tokens: Sequence[int], namespace: str, device_len: int) -> BelowHost:
        """What this tier, then the disk, hold of ``tokens`` past ``device_len`` tokens (the
        host path is touched; nothing is locked, loaded or read from disk: the disk's chunks
        are found by name, so whether a load pays is decided before any byte is read)."""
        h = self.tree.match(tokens, namespace)
        if self.disk is None:
            return BelowHost(h, [])
        return BelowHost(h, self.disk.match(tokens, namespace, max(device_len, h.num_tokens)))

    def read_below(self, below: BelowHost, tokens: Sequence[int], namespace: str) -> BelowHost:
        """``below`` with its disk chunks read and checked, cut at the first that is not
        whole and intact (removed by another node, damaged: rejected)."""
        if not below.refs:
            return below
        assert self.disk is not None
        t0 = time.perf_counter()
        chunks = self.disk.read_chunks(tokens, below.refs, namespace)
        return BelowHost(below.host, below.refs[: len(chunks)], chunks, time.perf_counter() - t0)

    def match(self, tokens: Sequence[int], namespace: str) -> TreeMatch:
        """The longest path of ``tokens`` held here (touches it; does not lock)."""
        return self.tree.match(tokens, namespace)

    def pays(self, num_host: int, num_disk: int = 0) -> bool:
        """Loading ``num_host`` tokens from here and ``num_disk`` from disk is faster than
        computing them, by the latest timings (True while a speed is unknown). A skip is counted."""
        prefill_tps = self.prefill_rate.value
        if prefill_tps is None:
            return True
        load_s = 0.0
        for n, rate in ((num_host, self.load_rate.value), (num_disk, self.disk_rate.value)):
            if n and rate is None:
                return True
            if n and rate:
                load_s += n * self.mover.num_bytes_per_token / rate
        if load_s < (num_host + num_disk) / prefill_tps:
            return True
        self._num_skipped += 1
        return False

    def lock(self, match: TreeMatch) -> None:
        """Keep ``match``'s path from being dropped (until ``unlock``)."""
        _lock(match.node, +1)

    def unlock(self, match: TreeMatch) -> None:
        _lock(match.node, -1)

    def load(self, match: TreeMatch, start: int, device_slots: Sequence[int]) -> None:
        """Copy ``match``'s tokens from ``start`` on into ``device_slots`` (one per token)."""
        host_slots = match.values[start : match.num_tokens]
        assert len(host_slots) == len(device_slots) and match.node.lock_ref > 0
        t0 = time.perf_counter()
        self.mover.load(host_slots, device_slots)
        seconds = time.perf_counter() - t0
        num_bytes = len(host_slots) * self.mover.num_bytes_per_token
        self.load_rate.add(num_bytes, seconds)
        self._num_hit += len(host_slots)
        self._num_loads += 1
        self._num_load_bytes += num_bytes
        self._load_seconds += seconds

    def load_chunks(self, below: BelowHost, start: int, device_slots: Sequence[int]) -> None:
        """Copy the disk chunks' tokens from path position ``start`` on into ``device_slots``
        (one per token)."""
        assert self.disk is not None and below.chunks and len(below.chunks) == len(below.refs)
        assert len(device_slots) == below.num_tokens - start
        t0 = time.perf_counter() - below.read_seconds
        i = 0
        for chunk in below.chunks:
            skip = max(0, start - chunk.start)
            n = chunk.end - chunk.start - skip
            self.mover.load_bytes(chunk.payload, skip, device_slots[i : i + n])
            i += n
        seconds = time.perf_counter() - t0
        num_bytes = len(device_slots) * self.mover.num_bytes_per_token
        self.disk_rate.add(num_bytes, seconds)
        self.disk.note_load(len(below.chunks), len(device_slots), num_bytes, seconds)

    # -- counters and checks --------------------------------------------------------------------

    @property
    def num_cached_tokens(self) -> int:
        return self._num_cached

    def held_len(self, tokens: Sequence[int], namespace: str) -> int:
        """Leading tokens of ``tokens`` held here (read-only: no touch, no split)."""
        return self.tree.held_len(tokens, namespace)

    @property
    def stats(self) -> TierStats:
        return TierStats(
            num_slots=self.allocator.num_slots,
            num_cached_tokens=self._num_cached,
            num_hit_tokens=self._num_hit,
            num_loads=self._num_loads,
            num_load_bytes=self._num_load_bytes,
            load_seconds=self._load_seconds,
            num_skipped=self._num_skipped,
            num_saved_tokens=self._num_saved,
            num_dropped_tokens=self._num_dropped,
            disk=None if self.disk is None else self.disk.stats,
        )

    def check_integrity(self) -> None:
        """Every host slot is free or held by one tree node; no lock is left; counts agree."""
        self.tree.check_integrity()
        owned: list[list[int]] = []
        num_cached = 0
        for node in self.tree.iter_nodes():
            assert node.value is not None and node.lock_ref == 0, f"host node {node}"
            owned.append(node.value)
            num_cached += len(node.key)
        assert num_cached == self._num_cached, f"{num_cached} held, counter {self._num_cached}"
        self.allocator.check_integrity(owned)


def _lock(node: RadixNode, delta: int) -> None:
    """Add ``delta`` to the lock count of every node on the path root..node."""
    cur: RadixNode | None = node
    while cur is not None and cur.parent is not None:
        cur.lock_ref += delta
        assert cur.lock_ref >= 0, f"unlock of an unlocked host node {cur}"
        cur = cur.parent
