"""HolderTree: one compact radix tree of the token paths many caches hold, each edge marked with
which of them hold it (plain Python, no torch).

The coordinator mirrors every node's RadixCache in one of these (``SharedPrefixIndex``), so a
routing decision walks the prompt once and learns every node's match length, instead of one walk
per node. Each node is a bit: ``held`` on an edge is the set of nodes whose cache holds the
whole edge, ``pending`` the set with a prompt routed there and not yet prefilled (a count per
node, as prompts share paths). Both are prefix-closed, so along any walk the marks only shrink:
a node's match length is where its bit drops out.

Memory is what keeps this usable at millions of cached tokens: a key is the edge's tokens as
4-byte unsigned ints in one ``bytes`` (no Python int per token), an edge is cut only where some
node's holding starts, stops or branches, and edges whose marks no longer differ are merged back,
so the tree is the same minimal shape whatever order the events came in.

Byte arithmetic (page_size = 2, so a page is 8 bytes): an edge for tokens (t4 .. t7) starts at
path byte 16 and has ``len(key) == 16``; a child dict is keyed by the first page, ``key[:8]``.
"""

from __future__ import annotations

import functools
import struct
from collections import Counter
from collections.abc import Iterator, Sequence

from pd.cache.holder_edge import Edge

TOKEN_BYTES = 4

# One step of a walk: (held mask, pending mask, tokens matched up to the end of this step).
WalkStep = tuple[int, int, int]


@functools.lru_cache(maxsize=4096)
def _packer(num_tokens: int) -> struct.Struct:
    return struct.Struct(f"<{num_tokens}I")  # compiled once: parsing a format string costs more than packing


def encode_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as the tree's keys: 4 bytes each (ids must be in [0, 2**32))."""
    try:
        return _packer(len(tokens)).pack(*tokens)
    except struct.error as e:
        bad = next((t for t in tokens if not 0 <= t < 1 << 32), None)
        raise ValueError(f"token id {bad} is out of [0, 2**32)") from e


class HolderTree:
    """Page-granular radix tree over encoded token keys, one subtree per namespace."""

    def __init__(self, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._page_bytes = page_size * TOKEN_BYTES
        self._roots: dict[str, Edge] = {}
        self.version = 0  # changes with every change of shape or marks

    # -- reading ----------------------------------------------------------------------------

    def walk(
        self, key: bytes, namespace: str = "", path: list[Edge] | None = None
    ) -> list[WalkStep]:
        """The marks along the longest page-aligned prefix of ``key`` in the tree, top down;
        the edges matched in full are appended to ``path`` (see ``add_pending``)."""
        node = self._roots.get(namespace)
        if node is None:
            return []
        pb = self._page_bytes
        end = len(key) - len(key) % pb
        steps: list[WalkStep] = []
        pos = 0
        children = node.children
        while children and pos < end:
            child = children.get(key[pos : pos + pb])
            if child is None:
                break
            edge = child.key
            if pos + len(edge) <= end and key.startswith(edge, pos):
                pos += len(edge)
                steps.append((child.held, child.pending, pos // TOKEN_BYTES))
                children = child.children
                if path is not None:
                    path.append(child)
            else:
                pos += self._common(edge, key, pos, end)
                steps.append((child.held, child.pending, pos // TOKEN_BYTES))
                break
        return steps

    # -- held paths (a node's cache events) -------------------------------------------------

    def insert(self, bit: int, key: bytes, namespace: str = "") -> int:
        """Mark the page-aligned path ``key`` held by ``bit``; returns the tokens newly held."""
        self._check_aligned(key)
        self.version += 1
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = Edge(b"", None)
        pos = num_new = 0
        while pos < len(key):
            child, common = self._step(node, key, pos)
            if child is None:
                break
            if common < len(child.key):
                if pos + common == len(key) and child.held & bit:
                    return num_new // TOKEN_BYTES  # ends inside an edge it already holds
                child = self._split(child, common)
            if not child.held & bit:
                child.held |= bit
                num_new += len(child.key)
            pos += common
            node = child
        if pos < len(key):
            node = self._attach(node, Edge(key[pos:], node, bit))
            num_new += len(key) - pos
        self._tidy(node, marks_added=True)
        return num_new // TOKEN_BYTES

    def remove_suffix(self, bit: int, key: bytes, namespace: str, num_tokens: int) -> None:
        """Unmark the last ``num_tokens`` of the path ``key``, which ``bit`` must hold and end
        at (as a leaf of its own tree). Raises ValueError, changing nothing, if it does not."""
        self._check_aligned(key)
        self.version += 1
        num_bytes = num_tokens * TOKEN_BYTES
        if not 0 < num_bytes <= len(key) or num_bytes % self._page_bytes:
            raise ValueError(f"evict {num_tokens} tokens of a {len(key) // TOKEN_BYTES}-token path")
        path, pos = self._held_path(bit, key, namespace)
        below = (path[-1].children or {}).values() if path else ()
        beyond = pos > len(key) or any(c.held & bit for c in below)
        if pos < len(key) or beyond:
            raise ValueError(
                f"evicted path of {len(key) // TOKEN_BYTES} tokens: index holds "
                f"{min(pos, len(key)) // TOKEN_BYTES} of it{' and more below' if beyond else ''}"
            )
        covered = 0
        for i in range(len(path) - 1, -1, -1):  # check that the run stays on one branch first
            if i < len(path) - 1 and sum(c.held & bit != 0 for c in path[i].children.values()) > 1:
                raise ValueError(f"evicted {num_tokens} tokens run past a branch of the node")
            covered += len(path[i].key)
            if covered >= num_bytes:
                break
        left = num_bytes
        for edge in reversed(path):
            if left < len(edge.key):
                self._split(edge, len(edge.key) - left)
            edge.held &= ~bit
            left -= len(edge.key)
            if left <= 0:
                break
        self._tidy(path[-1], marks_added=False)

    # -- pending paths (prompts routed and not yet prefilled) -------------------------------

    def add_pending(
        self, bit: int, key: bytes, namespace: str = "", *, start: Sequence[Edge] = ()
    ) -> None:
        """Count one more prompt of node ``bit`` in flight along the page-aligned path ``key``.
        ``start``: the edges a ``walk`` of a prefix of ``key`` matched in full, with no change
        to the tree since (``version`` tells): they are not walked again."""
        self._check_aligned(key)
        self.version += 1
        if not key:
            return
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = Edge(b"", None)
        pos = 0
        for edge in start:
            edge.pend(bit)
            pos += len(edge.key)
            node = edge
        while pos < len(key):
            child, common = self._step(node, key, pos)
            if child is None:
                child = self._attach(node, Edge(key[pos:], node))
                common = len(child.key)
            elif common < len(child.key):
                child = self._split(child, common)
            child.pend(bit)
            pos += common
            node = child

    def remove_pending(self, bit: int, key: bytes, namespace: str = "") -> None:
        """Undo one ``add_pending(bit, key, namespace)``."""
        self._check_aligned(key)
        self.version += 1
        if not key:  # a prompt shorter than a page: add_pending counted nothing
            return
        node = self._roots[namespace]
        pos = 0
        while pos < len(key):
            child, common = self._step(node, key, pos)
            assert child is not None and common == len(child.key), "pending path not found"
            child.unpend(bit, 1)
            pos += common
            node = child
        if pos:
            self._tidy(node, marks_added=False)

    # -- whole-node changes -----------------------------------------------------------------

    def clear(self, bit: int, *, pending: bool) -> None:
        """Drop ``bit`` from every held mark (and every pending count with ``pending``)."""
        self.version += 1
        for root in self._roots.values():
            order = list(root.subtree())
            for edge in order:
                edge.held &= ~bit
                if pending and edge.pending & bit:
                    edge.unpend(bit, None)
            for edge in reversed(order):  # children before parents
                self._tidy_one(edge)

    # -- checks and inspection --------------------------------------------------------------

    def iter_edges(self) -> Iterator[tuple[str, bytes, int, dict[int, int]]]:
        """(namespace, full path key, held mask, pending counts) of every edge, parents first."""
        for namespace, path, edge in self._iter_paths():
            yield namespace, path, edge.held, dict(edge.num_pending or {})

    def pending_paths(self) -> Counter[tuple[int, str, bytes]]:
        """How many pending prompts of each (bit, namespace, path) were added."""
        out: Counter[tuple[int, str, bytes]] = Counter()
        for namespace, path, edge in self._iter_paths():
            ending = Counter(edge.num_pending or {})
            for child in (edge.children or {}).values():
                ending.subtract(child.num_pending or {})
            for bit, n in ending.items():
                if n:
                    out[bit, namespace, path] = n
        return out

    def check_integrity(self) -> None:
        """Keys whole pages, children keyed by their first page, marks prefix-closed, no empty
        leaf, and no edge that should have been merged with its only child."""
        pb = self._page_bytes
        for root in self._roots.values():
            assert root.parent is None and not root.key and not root.held and not root.pending
            for edge in root.subtree():
                parent = edge.parent
                assert parent is not None and parent.children is not None
                assert edge.key and len(edge.key) % pb == 0, f"edge of {len(edge.key)} bytes"
                assert parent.children.get(edge.key[:pb]) is edge, "child not keyed by first page"
                assert edge.held or edge.pending or edge.children, "unmarked leaf left behind"
                assert edge.children is None or edge.children, "empty child dict"
                counts = edge.num_pending or {}
                assert edge.pending == sum(counts), f"pending mask {edge.pending} for {counts}"
                assert all(n > 0 for n in counts.values()), f"bad counts {counts}"
                if parent.parent is not None:
                    assert edge.held & ~parent.held == 0, "held below a parent that is not"
                    pcounts = parent.num_pending or {}
                    assert all(n <= pcounts.get(b, 0) for b, n in counts.items()), (
                        f"pending {counts} below {pcounts}"
                    )
                if edge.children and len(edge.children) == 1:
                    (only,) = edge.children.values()
                    assert not edge.same_marks(only), "unmerged edge with one same-marked child"

    # -- internals --------------------------------------------------------------------------

    def _held_path(self, bit: int, key: bytes, namespace: str) -> tuple[list[Edge], int]:
        """The edges held by ``bit`` along ``key`` and the bytes they cover; the count is past
        ``len(key)`` when the key ends inside the last held edge."""
        node = self._roots.get(namespace)
        path: list[Edge] = []
        pos = 0
        while node is not None and pos < len(key):
            child, common = self._step(node, key, pos)
            if child is None or not child.held & bit:
                break
            if common < len(child.key):
                if pos + common == len(key):
                    pos += len(child.key)  # the node holds more of this edge than the key
                else:
                    pos += common
                break
            path.append(child)
            pos += common
            node = child
        return path, pos

    def _step(self, node: Edge, key: bytes, pos: int) -> tuple[Edge | None, int]:
        """The child of ``node`` that ``key[pos:]`` enters, and the bytes of it they share."""
        child = node.children.get(key[pos : pos + self._page_bytes]) if node.children else None
        if child is None:
            return None, 0
        if key.startswith(child.key, pos):
            return child, len(child.key)
        return child, self._common(child.key, key, pos, len(key))

    def _common(self, edge: bytes, key: bytes, pos: int, end: int) -> int:
        """Bytes at the start of ``edge`` equal to ``key[pos:end]``, in whole pages."""
        n = min(len(edge), end - pos)
        diff = int.from_bytes(edge[:n], "big") ^ int.from_bytes(key[pos : pos + n], "big")
        common = n - (diff.bit_length() + 7) // 8  # the first differing byte
        return common - common % self._page_bytes

    def _check_aligned(self, key: bytes) -> None:
        if len(key) % self._page_bytes:
            raise ValueError(
                f"key of {len(key) // TOKEN_BYTES} tokens is not whole pages of {self.page_size}"
            )

    def _attach(self, parent: Edge, edge: Edge) -> Edge:
        if parent.children is None:
            parent.children = {}
        parent.children[edge.key[: self._page_bytes]] = edge
        return edge

    def _split(self, edge: Edge, num_bytes: int) -> Edge:
        """Cut ``edge`` after ``num_bytes``; returns the new upper edge (same marks), ``edge``
        keeps the rest."""
        parent = edge.parent
        assert parent is not None and 0 < num_bytes < len(edge.key)
        upper = Edge(edge.key[:num_bytes], parent, edge.held)
        upper.pending = edge.pending
        upper.num_pending = None if edge.num_pending is None else dict(edge.num_pending)
        self._attach(parent, upper)
        edge.key = edge.key[num_bytes:]
        edge.parent = upper
        self._attach(upper, edge)
        return upper

    def _tidy(self, edge: Edge, *, marks_added: bool) -> None:
        """Restore the minimal shape on the path up from ``edge``. After marks were added along
        root..``edge``, any edge on it may now equal its only child. After marks were taken
        from a run of edges ending at ``edge``, the run keeps its differences: only ``edge`` may
        have emptied (then its parent is next) or become equal to its only child."""
        node: Edge | None = edge
        while node is not None and node.parent is not None:
            parent = node.parent
            if not self._tidy_one(node) and not marks_added:
                return
            node = parent

    def _tidy_one(self, edge: Edge) -> bool:
        """Detach ``edge`` if it is an unmarked leaf (True), else merge it with its only child
        if their marks are the same."""
        parent = edge.parent
        if parent is None:
            return False
        if not edge.children:
            if edge.held or edge.pending:
                return False
            assert parent.children is not None
            del parent.children[edge.key[: self._page_bytes]]
            if not parent.children:
                parent.children = None
            edge.parent = None
            return True
        if len(edge.children) == 1:
            (only,) = edge.children.values()
            if edge.same_marks(only):
                edge.key += only.key
                edge.children = only.children
                for child in (edge.children or {}).values():
                    child.parent = edge
                only.parent = None
        return False

    def _iter_paths(self) -> Iterator[tuple[str, bytes, Edge]]:
        for namespace, root in self._roots.items():
            paths = {id(root): b""}
            for edge in root.subtree():
                assert edge.parent is not None
                path = paths[id(edge)] = paths[id(edge.parent)] + edge.key
                yield namespace, path, edge
