"""``CacheEvents``: what a node's cache tells the coordinator, whose ``PrefixIndex`` replays it.

Every insertion and eviction becomes a ``CacheEventMsg`` with the next ``seq``; the events
describe what the node holds in either tier (the device pool's tree and, with a host tier, the
host's): an eviction the host keeps emits nothing, and the host's drops emit what neither holds
(``dropped_below``). The log is bounded so an undrained cache cannot grow without limit; a
consumer that falls behind sees a seq gap and asks for ``snapshot``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from pd.cache.host_tier import Dropped
from pd.cache.radix_tree import RadixTree
from pd.core.messages import CacheEventMsg


class CacheEvents:
    """The event log of the cache of node ``node_id`` over ``trees`` (the device's first)."""

    def __init__(self, node_id: str, trees: list[RadixTree], max_pending: int) -> None:
        self.node_id = node_id
        self._trees = trees
        self._next_seq = 0
        self._events: deque[CacheEventMsg] = deque(maxlen=max_pending)

    @property
    def next_seq(self) -> int:
        """The seq the next event will carry."""
        return self._next_seq

    def emit(self, kind: str, namespace: str, tokens: list[int], num_evicted: int = 0) -> None:
        self._events.append(
            CacheEventMsg(
                node_id=self.node_id,
                seq=self._next_seq,
                kind=kind,
                namespace=namespace,
                tokens=tokens,
                num_evicted=num_evicted,
            )
        )
        self._next_seq += 1

    def dropped_below(self, dropped: Iterable[Dropped]) -> None:
        """The host tier dropped these paths for room: what the device does not hold either
        is gone from this node, an eviction event for each."""
        device = self._trees[0]
        for d in dropped:
            still = max(len(d.path) - d.num_tokens, device.held_len(d.path, d.namespace))
            if still < len(d.path):
                self.emit("evicted", d.namespace, d.path, len(d.path) - still)

    def take(self) -> list[CacheEventMsg]:
        events = list(self._events)
        self._events.clear()
        return events

    def snapshot(self) -> list[CacheEventMsg]:
        """A ``reset`` then one ``inserted`` per leaf path: the whole cache as events.

        Replaces the pending events (they are dropped), so a consumer that applies the snapshot
        and then the later ``take`` is exactly in step again.
        """
        self._events.clear()
        self.emit("reset", "", [])
        for tree in self._trees:  # what the node holds in either tier
            for node in tree.iter_nodes():
                if not node.children:
                    self.emit("inserted", node.namespace, tree.path_tokens(node))
        return self.take()
