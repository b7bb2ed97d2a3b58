"""Wire messages of the control plane (msgspec Structs, never pickle on a socket)."""

from __future__ import annotations

import msgspec


class CacheEventMsg(msgspec.Struct, tag="cache_event", frozen=True):
    """One change to a prefill node's RadixCache, replayable by the coordinator (PrefixIndex).

    ``tokens`` is the full token path from the namespace root (page-aligned when page_size > 1).
    ``inserted``: the cache now holds that whole path. ``evicted``: the last ``num_evicted``
    tokens of that path are gone (the rest stays). ``reset``: drop everything held for this
    node (``tokens`` is empty); the ``inserted`` events that follow are a full snapshot.
    ``seq`` increases by one per event of a cache, so a consumer detects a gap and asks for a
    snapshot; a ``reset`` may jump ahead (the events it replaces are never sent).
    """

    node_id: str
    seq: int
    kind: str  # "inserted" | "evicted" | "reset"
    namespace: str
    tokens: list[int]
    num_evicted: int = 0
