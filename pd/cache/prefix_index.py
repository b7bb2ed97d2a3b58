"""PrefixIndex: the coordinator's mirror of one node's RadixCache; SharedPrefixIndex: all of
them in one HolderTree.

A PrefixIndex replays its node's CacheEventMsg stream, so it knows which token paths the node
holds (not where), and answers ``match_len`` the way the node's ``match_prefix`` would. Events
carry a per-node ``seq``: an event that skips ahead means some were lost, so the index stops
applying and flags ``needs_resync`` until a ``reset`` event (the head of the node's
``take_snapshot()``) arrives; the ``inserted`` events after it rebuild the node's view exactly.
While flagged, ``match_len`` answers from the last consistent state, which is good enough for
routing, never for correctness. Namespaces never match across.

The indexes of a SharedPrefixIndex are views of one tree (a node is a bit on its edges), so
``match`` walks a prompt once for every node; it also counts prompts routed to a node and not yet
prefilled (``add_pending``), which the node will hold by the time a follower is admitted there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from pd.cache.holder_edge import Edge
from pd.cache.holder_tree import TOKEN_BYTES, HolderTree, WalkStep, encode_tokens
from pd.core.messages import CacheEventMsg

EVENT_KINDS = ("inserted", "evicted", "reset")


class PrefixIndex:
    """Which token paths one node's cache holds, per namespace: one bit of a HolderTree."""

    def __init__(
        self, page_size: int, node_id: str = "", *, tree: HolderTree | None = None, bit: int = 1
    ) -> None:
        self.page_size = page_size
        self.node_id = node_id
        self.next_seq = 0  # seq of the next event to apply
        self.needs_resync = False
        self._tree = HolderTree(page_size) if tree is None else tree
        self._bit = bit
        self._num_cached = 0

    @property
    def num_cached_tokens(self) -> int:
        return self._num_cached

    @property
    def bit(self) -> int:
        return self._bit

    def match_len(self, tokens: Sequence[int], namespace: str = "") -> int:
        """Tokens of the longest page-aligned prefix of ``tokens`` the node holds."""
        return PrefixMatch(self._tree.walk(encode_tokens(tokens), namespace), [], 0).held_len(
            self._bit
        )

    def apply(self, event: CacheEventMsg) -> bool:
        """Replay one event; False if it was skipped (an old duplicate, or out of step)."""
        if event.node_id != self.node_id:
            raise ValueError(f"event of node {event.node_id!r} sent to index of {self.node_id!r}")
        if event.kind not in EVENT_KINDS:
            raise ValueError(f"unknown cache event kind {event.kind!r} (seq {event.seq})")
        if event.kind == "reset":
            self._tree.clear(self._bit, pending=False)
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
        key = encode_tokens(event.tokens)
        try:
            if event.kind == "inserted":
                self._num_cached += self._tree.insert(self._bit, key, event.namespace)
            else:
                self._tree.remove_suffix(self._bit, key, event.namespace, event.num_evicted)
                self._num_cached -= event.num_evicted
        except ValueError as e:
            self.needs_resync = True
            raise ValueError(f"{e} (node {self.node_id!r}, seq {event.seq})") from e
        return True

    def apply_snapshot(self, events: Sequence[CacheEventMsg]) -> None:
        """Replace the view with a node's ``take_snapshot()``: a ``reset``, then ``inserted``s."""
        if not events or events[0].kind != "reset":
            head = events[0].kind if events else "nothing"
            raise ValueError(f"a snapshot starts with a reset event, got {head}")
        for event in events:
            self.apply(event)

    def detach(self) -> None:
        """The node left its SharedPrefixIndex: answer from an empty tree of its own."""
        self._tree, self._bit, self._num_cached = HolderTree(self.page_size), 1, 0


class PrefixMatch(NamedTuple):
    """One prompt walked through a SharedPrefixIndex: the marks along its path, top down. Marks
    only shrink along it, so a node matches up to the deepest step it is in (page-aligned
    tokens); every node's answer comes from this one walk."""

    steps: list[WalkStep]
    path: list[Edge]  # the edges matched in full, for add_pending(after=...)
    version: int  # of the tree when walked

    def held_len(self, bit: int) -> int:
        """Tokens node ``bit``'s cache holds."""
        for held, _, num_tokens in reversed(self.steps):
            if held & bit:
                return num_tokens
        return 0

    def expected_len(self, bit: int) -> int:
        """Tokens node ``bit`` holds or has in flight (prompts routed there, not prefilled)."""
        for held, pending, num_tokens in reversed(self.steps):
            if (held | pending) & bit:
                return num_tokens
        return 0

    def longest_held(self, among: int) -> tuple[int, int]:
        """The bits of ``among`` whose caches hold the most of the prompt, and how many
        tokens; (0, 0) when none holds any."""
        for held, _, num_tokens in reversed(self.steps):
            if mask := held & among:
                return mask, num_tokens
        return 0, 0

    def longest_expected(self, among: int) -> tuple[int, int]:
        """The bits of ``among`` expected to hold the most of the prompt, and how many tokens;
        (0, 0) when none holds any."""
        for held, pending, num_tokens in reversed(self.steps):
            mask = (held | pending) & among
            if mask:
                return mask, num_tokens
        return 0, 0


class SharedPrefixIndex:
    """The PrefixIndex of every node, sharing one HolderTree."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.tree = HolderTree(page_size)
        self._indexes: dict[str, PrefixIndex] = {}
        self._used_bits = 0

    def add(self, node_id: str) -> PrefixIndex:
        if node_id in self._indexes:
            raise ValueError(f"node {node_id!r} is already indexed")
        used = self._used_bits
        bit = ~used & (used + 1)  # the lowest free one
        self._used_bits |= bit
        index = self._indexes[node_id] = PrefixIndex(
            self.page_size, node_id, tree=self.tree, bit=bit
        )
        return index

    def remove(self, node_id: str) -> None:
        index = self._indexes.pop(node_id, None)
        if index is None:
            return
        self.tree.clear(index.bit, pending=True)
        self._used_bits &= ~index.bit
        index.detach()

    def index(self, node_id: str) -> PrefixIndex:
        return self._indexes[node_id]

    def __contains__(self, node_id: str) -> bool:
        return node_id in self._indexes

    def apply(self, event: CacheEventMsg) -> bool:
        """Replay one event into its node's index; False if skipped or the node is unknown."""
        index = self._indexes.get(event.node_id)
        return index is not None and index.apply(event)

    @property
    def nodes_to_resync(self) -> list[str]:
        """Nodes whose index missed events and waits for a snapshot."""
        return [n for n, index in self._indexes.items() if index.needs_resync]

    def match(self, key: bytes, namespace: str = "") -> PrefixMatch:
        """Every node's match of the encoded tokens ``key`` (see ``encode_tokens``)."""
        path: list[Edge] = []
        return PrefixMatch(self.tree.walk(key, namespace, path), path, self.tree.version)

    def add_pending(
        self, node_id: str, key: bytes, namespace: str = "", after: PrefixMatch | None = None
    ) -> None:
        """A prompt (encoded) is routed to ``node_id``; its whole pages count as expected there
        until ``remove_pending`` with the same arguments. ``after``: the ``match`` of a prefix
        of the prompt, whose walk is reused if nothing changed since."""
        start = after.path if after is not None and after.version == self.tree.version else ()
        bit = self._indexes[node_id].bit
        self.tree.add_pending(bit, self._aligned(key), namespace, start=start)

    def remove_pending(self, node_id: str, key: bytes, namespace: str = "") -> None:
        index = self._indexes.get(node_id)
        if index is not None:  # a removed node's pending prompts went with it
            self.tree.remove_pending(index.bit, self._aligned(key), namespace)

    def check_integrity(self, pending: Iterable[tuple[str, bytes, str]] = ()) -> None:
        """The tree's shape, and its pending prompts are exactly ``pending`` (node id, encoded
        prompt, namespace), as the caller booked them."""
        self.tree.check_integrity()
        want = Counter(
            (self._indexes[node_id].bit, namespace, self._aligned(key))
            for node_id, key, namespace in pending
            if len(key) >= self.page_size * TOKEN_BYTES
        )
        assert self.tree.pending_paths() == want, "pending prompts differ from those booked"

    def _aligned(self, key: bytes) -> bytes:
        extra = len(key) % (self.page_size * TOKEN_BYTES)
        return key[: len(key) - extra] if extra else key
