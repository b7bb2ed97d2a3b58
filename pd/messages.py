"""Wire messages of the control plane (msgspec Structs, never pickle on a socket)."""

from __future__ import annotations

import msgspec


class CacheEventMsg(msgspec.Struct, tag="cache_event", frozen=True):
    """One change to a prefill node's RadixCache, replayable by the coordinator.

    ``tokens`` is the full token path from the root (page-aligned when page_size > 1): an
    ``inserted`` event means the cache now holds that whole path, an ``evicted`` event means the
    last ``num_evicted`` tokens of that path are gone (the rest stays). ``seq`` increases by one
    per event of a cache, so a consumer can detect a gap and ask for a snapshot.
    """

    node_id: str
    seq: int
    kind: str  # "inserted" | "evicted"
    namespace: str
    tokens: list[int]
    num_evicted: int = 0
