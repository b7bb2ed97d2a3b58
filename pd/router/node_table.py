"""``NodeTable``: the coordinator's nodes, prefill and decode, each with its state (load, booked
slots, its mirror in the ``SharedPrefixIndex``), and ``Members``, the table of nodes accepting
requests that the policy chooses over, rebuilt after a node is added, drained or removed.

A node's state, not its id, is what a booking holds: a node removed and registered again is a
new state (``is_current`` tells the two apart).
"""

from __future__ import annotations

import itertools
from array import array

from pd.cache.prefix_index import SharedPrefixIndex
from pd.router.policy import DecodeState, Members, PrefillState


class NodeTable:
    def __init__(self, mirror: SharedPrefixIndex) -> None:
        """``mirror``: every node's cache, where a node added gets its index."""
        self._mirror = mirror
        self.prefill: dict[str, PrefillState] = {}
        self.decode: dict[str, DecodeState] = {}
        self._ranks = itertools.count()
        self._members: Members | None = None  # rebuilt after membership changes

    def add_prefill(self, node_id: str) -> None:
        self.remove(node_id)  # a node that registers again starts from nothing
        index = self._mirror.add(node_id)
        self.prefill[node_id] = PrefillState(node_id, index, next(self._ranks))

    def add_decode(self, node_id: str, num_slots: int) -> None:
        self.remove(node_id)
        self.decode[node_id] = DecodeState(node_id, num_slots, self._mirror.add(node_id))

    def drain(self, node_id: str) -> None:
        """Send no new requests to this node."""
        (self.prefill.get(node_id) or self.decode[node_id]).draining = True
        self._members = None

    def remove(self, node_id: str) -> None:
        self._members = None
        node = self.prefill.pop(node_id, None)
        if node is not None:
            node.pos = -1  # its requests may still finish: their loads go nowhere
        self.decode.pop(node_id, None)
        self._mirror.remove(node_id)

    @property
    def prefill_nodes(self) -> list[str]:
        return list(self.prefill)

    @property
    def decode_nodes(self) -> list[str]:
        return list(self.decode)

    def load(self, node_id: str) -> int:
        return self.prefill[node_id].load

    def num_reserved_slots(self, node_id: str) -> int:
        """KV slots booked on a decode node (more than it has when answers outgrew them)."""
        return self.decode[node_id].reserved

    def is_current(self, node: PrefillState | DecodeState) -> bool:
        """``node`` is the state of a registered node (not one removed since)."""
        table: dict[str, PrefillState] | dict[str, DecodeState]
        table = self.prefill if isinstance(node, PrefillState) else self.decode
        return table.get(node.node_id) is node

    def add_load(self, node: PrefillState, delta: int) -> None:
        """The one place a prefill node's load changes, with the members' copy."""
        node.load += delta
        if node.pos >= 0 and self._members is not None:
            self._members.loads[node.pos] += delta

    def members(self) -> Members:
        """The nodes accepting requests (cached until a node is added, drained or removed)."""
        if self._members is None:
            accepting = [p for p in self.prefill.values() if not p.draining]
            for node in self.prefill.values():
                node.pos = -1
            for pos, node in enumerate(accepting):
                node.pos = pos
            holders = {p.index.bit: n for n, p in self.prefill.items()}
            holders.update((d.index.bit, n) for n, d in self.decode.items())
            self._members = Members(
                accepting,
                array("q", [p.load for p in accepting]),
                sum(p.index.bit for p in accepting),
                {p.index.bit: p for p in accepting},
                [d for d in self.decode.values() if not d.draining],
                dict(self.prefill),
                holders,
            )
        return self._members

    def check_integrity(self) -> None:
        """The members' loads are the nodes' loads."""
        if self._members is not None:
            assert [p.load for p in self._members.accepting] == list(self._members.loads)
