"""PrefixIndex: the coordinator's mirror of one prefill node's RadixCache.

It replays the node's CacheEventMsg stream into a RadixTree without values, so it knows which
token paths the node holds (not where), and answers ``match_len`` the way the node's
``match_prefix`` would. Events carry a per-node ``seq``: an event that skips ahead means some
were lost, so the index stops applying and flags ``needs_resync`` until a ``reset`` event (the
head of the node's ``take_snapshot()``) arrives. While flagged, ``match_len`` answers from the
last consistent state, which is good enough for routing, never for correctness.
"""

from __future__ import annotations

from collections.abc import Sequence

from pd.cache.radix_tree import RadixTree
from pd.messages import CacheEventMsg


class PrefixIndex:
    """Which token paths one prefill node's cache holds, per namespace."""

    def __init__(self, page_size: int, node_id: str = "") -> None:
        self.page_size = page_size
        self.node_id = node_id
        self.next_seq = 0  # seq of the next event to apply
        self.needs_resync = False
        self._tree = RadixTree(page_size)
        self._num_cached = 0

    @property
    def num_cached_tokens(self) -> int:
        return self._num_cached

    def match_len(self, tokens: Sequence[int], namespace: str = "") -> int:
        """Tokens of the longest page-aligned prefix of ``tokens`` the node holds."""
        return self._tree.match(tokens, namespace, split=False).num_tokens

    def apply(self, event: CacheEventMsg) -> bool:
        """Replay one event; False if it was skipped (an old duplicate, or out of step)."""
        if event.node_id != self.node_id:
            raise ValueError(f"event of node {event.node_id!r} sent to index of {self.node_id!r}")
        if event.kind not in ("inserted", "evicted", "reset"):
            raise ValueError(f"unknown cache event kind {event.kind!r} (seq {event.seq})")
        if event.kind == "reset":
            self._tree = RadixTree(self.page_size)
            self._num_cached = 0
            self.needs_resync = False
            self.next_seq = event.seq + 1
            return True
        if event.seq < self.next_seq:
            return False
        if event.seq > self.next_seq or self.needs_resync:
            self.needs_resync = True
            return False
        self.next_seq += 1
        if event.kind == "inserted":
            ins = self._tree.insert(event.tokens, None, event.namespace)
            self._num_cached += len(event.tokens) - ins.num_existing
        else:
            self._remove_suffix(event.tokens, event.namespace, event.num_evicted)
        return True

    def _remove_suffix(self, tokens: Sequence[int], namespace: str, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` of the held path ``tokens``, which must end at a leaf."""
        m = self._tree.match(tokens, namespace)
        if m.num_tokens != len(tokens) or m.node.children:
            self.needs_resync = True
            raise ValueError(
                f"evicted path of {len(tokens)} tokens: index holds {m.num_tokens} of it"
                f"{' and more below' if m.node.children else ''} (seq {self.next_seq - 1})"
            )
        node = m.node
        left = num_tokens
        while left:
            parent = node.parent
            assert parent is not None and not node.children, "evicted tokens run past a branch"
            take = min(left, len(node.key))
            self._tree.trim_leaf(node, take)
            left -= take
            node = parent
        self._num_cached -= num_tokens
