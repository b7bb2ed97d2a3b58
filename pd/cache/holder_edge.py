"""An edge of a ``pd.cache.holder_tree.HolderTree``: its tokens and which caches hold it or
have a prompt in flight through it (plain Python)."""

from __future__ import annotations

from collections.abc import Iterator


class Edge:
    """One edge: its tokens and marks (opaque to callers, who only pass a walk's back)."""

    __slots__ = ("key", "parent", "children", "held", "pending", "num_pending")

    def __init__(self, key: bytes, parent: Edge | None, held: int = 0) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[bytes, Edge] | None = None  # None for a leaf: a dict costs 64+ B
        self.held = held
        self.pending = 0
        self.num_pending: dict[int, int] | None = None  # bit -> prompts in flight through here

    def same_marks(self, other: Edge) -> bool:
        return self.held == other.held and self.num_pending == other.num_pending

    def pend(self, bit: int) -> None:
        """One more prompt of node ``bit`` in flight through here."""
        counts = self.num_pending
        if counts is None:
            self.num_pending = {bit: 1}
        else:
            counts[bit] = counts.get(bit, 0) + 1
        self.pending |= bit

    def unpend(self, bit: int, num: int | None) -> None:
        """Take ``num`` (None: all) of node ``bit``'s pending prompts off here."""
        counts = self.num_pending
        assert counts and bit in counts, f"no pending prompt of bit {bit} here"
        if num is not None and counts[bit] > num:
            counts[bit] -= num
            return
        del counts[bit]
        self.pending &= ~bit
        if not counts:
            self.num_pending = None

    def subtree(self) -> Iterator[Edge]:
        """Every edge below this one, parents before children."""
        stack = list((self.children or {}).values())
        while stack:
            edge = stack.pop()
            yield edge
            if edge.children:
                stack.extend(edge.children.values())
