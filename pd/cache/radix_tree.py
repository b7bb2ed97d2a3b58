"""A token radix tree: the structure behind the RadixCache (plain Python, no torch). The
coordinator mirrors caches in the more compact ``HolderTree`` instead.

Keys are token-id sequences cut into pages of ``page_size`` tokens. Every edge holds a whole
number of pages, and a node's children are keyed by the first page of their edge, so each step
down the tree is one dict probe. Each namespace (tenant / LoRA id) has its own root, so prefixes
never match across namespaces.

A node may carry a value list aligned with its key (the RadixCache stores slot indices; a tree
without values is the per-node mirror that ``pdtools/routing_model.py`` measures as a baseline);
values split with their keys. ``lock_ref`` and ``last_access`` live on the node so that a split
copies them, but only the RadixCache gives them meaning. Nodes are never merged: a node object
keeps its identity (and its path end) until it is removed, which is what lets a caller hold one
as a handle while other requests split the path above it.

Page arithmetic (page_size = 4), a node whose edge starts at path position 8:

    key   = (t8 .. t15)       two pages
    split(node, 4)  ->  upper.key = (t8 .. t11), node.key = (t12 .. t15), node.parent = upper
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from pd.cache.tenants import TenantShares, tenant_of


class RadixNode:
    """One edge of the tree: ``key`` tokens (whole pages) and the values aligned with them."""

    __slots__ = ("key", "value", "children", "parent", "namespace", "lock_ref", "last_access")

    def __init__(
        self,
        key: tuple[int, ...],
        value: list[int] | None,
        parent: RadixNode | None,
        namespace: str,
    ) -> None:
        self.key = key
        self.value = value
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.namespace = namespace
        # Number of holders whose locked path runs through this node (RadixCache only).
        self.lock_ref = 0
        # Logical clock of the last match/insert that walked through this node.
        self.last_access = 0

    @property
    def num_tokens(self) -> int:
        return len(self.key)

    @property
    def is_root(self) -> bool:
        return self.parent is None and not self.key

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return (
            f"RadixNode(ns={self.namespace!r}, num_tokens={len(self.key)}, "
            f"children={len(self.children)}, lock_ref={self.lock_ref})"
        )


class TreeMatch(NamedTuple):
    node: RadixNode  # deepest node of the match, ending exactly at num_tokens
    num_tokens: int  # matched tokens, a multiple of page_size
    values: list[int]  # values along the matched path, a fresh list ([] when none are stored)


class TreeInsert(NamedTuple):
    node: RadixNode  # the node whose path ends exactly at the end of the inserted key
    num_existing: int  # leading tokens of the key that were already in the tree
    existing_values: list[int]  # their values (a fresh list)


class RadixTree:
    """Page-granular radix tree over token sequences, one subtree per namespace."""

    def __init__(self, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.roots: dict[str, RadixNode] = {}
        self.clock = 0

    def root(self, namespace: str = "") -> RadixNode:
        node = self.roots.get(namespace)
        if node is None:
            node = self.roots[namespace] = RadixNode((), None, None, namespace)
        return node

    def match(self, tokens: Sequence[int], namespace: str = "") -> TreeMatch:
        """Longest page-aligned prefix of ``tokens`` held in ``namespace``; touches its nodes.

        A match that ends inside a node splits it, so that ``node`` ends exactly at the match.
        """
        self.clock += 1
        return self._walk(tuple(tokens), namespace)

    def continuation(self, tokens: Sequence[int], namespace: str, k: int) -> list[int]:
        """Up to ``k`` tokens that follow the whole of ``tokens`` in the tree (along the most
        recently used branch), or [] if the tree does not hold all of ``tokens``. Read-only:
        nothing is split or touched (speculative decoding's guess from what was cached)."""
        key, ps = tuple(tokens), self.page_size
        node, pos, out = self.roots.get(namespace), 0, []
        while node is not None and pos < len(key):
            rest = key[pos:]
            if len(rest) >= ps:
                child = node.children.get(rest[:ps])
            else:  # a partial last page: the child whose key starts with it
                child = next((c for p, c in node.children.items() if p[: len(rest)] == rest), None)
            n = min(len(rest), child.num_tokens) if child is not None else 0
            if child is None or child.key[:n] != rest[:n]:
                return []
            out, pos, node = list(child.key[n : n + k]), pos + n, child
        if node is None or not key:
            return []
        while len(out) < k and node.children:
            node = max(node.children.values(), key=lambda c: c.last_access)
            out.extend(node.key[: k - len(out)])
        return out

    def insert(
        self, tokens: Sequence[int], values: Sequence[int] | None, namespace: str = ""
    ) -> TreeInsert:
        """Add the page-aligned path ``tokens`` (sharing any prefix already held); touches it.

        The part already in the tree keeps its values; ``values[num_existing:]`` go to the new
        node. A key that ends inside a node or diverges inside it splits that node.
        """
        key = tuple(tokens)
        ps = self.page_size
        if len(key) % ps:
            raise ValueError(f"insert key of {len(key)} tokens is not a multiple of page {ps}")
        if values is not None and len(values) != len(key):
            raise ValueError(f"{len(values)} values for a key of {len(key)} tokens")
        self.clock += 1
        node, pos, existing = self._walk(key, namespace)
        if pos < len(key):
            new = RadixNode(
                key[pos:], None if values is None else list(values[pos:]), node, namespace
            )
            new.last_access = self.clock
            node.children[key[pos : pos + ps]] = new
            node = new
        return TreeInsert(node, pos, existing)

    def split(self, node: RadixNode, num_tokens: int) -> RadixNode:
        """Cut ``node`` after ``num_tokens``; returns the new upper node, ``node`` keeps the rest.

        The upper node inherits lock_ref and last_access: every lock through the old node runs
        through both halves.
        """
        ps = self.page_size
        assert node.parent is not None, "cannot split a root"
        assert 0 < num_tokens < len(node.key) and num_tokens % ps == 0, (
            f"split at {num_tokens} of a {len(node.key)}-token node (page {ps})"
        )
        upper = RadixNode(
            node.key[:num_tokens],
            None if node.value is None else node.value[:num_tokens],
            node.parent,
            node.namespace,
        )
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        node.parent.children[upper.key[:ps]] = upper
        node.key = node.key[num_tokens:]
        if node.value is not None:
            node.value = node.value[num_tokens:]
        node.parent = upper
        upper.children[node.key[:ps]] = node
        return upper

    def trim_leaf(self, node: RadixNode, num_tokens: int) -> list[int]:
        """Drop the last ``num_tokens`` of a leaf (the whole leaf detaches it); returns their values.

        A detached node gets ``parent = None`` so that a stale handle to it fails loudly.
        """
        ps = self.page_size
        assert node.parent is not None and not node.children, f"trim of a non-leaf {node}"
        assert 0 < num_tokens <= len(node.key) and num_tokens % ps == 0, (
            f"trim {num_tokens} of a {len(node.key)}-token node (page {ps})"
        )
        keep = len(node.key) - num_tokens
        removed = [] if node.value is None else node.value[keep:]
        if keep == 0:
            del node.parent.children[node.key[:ps]]
            node.parent = None
        else:
            node.key = node.key[:keep]
            if node.value is not None:
                node.value = node.value[:keep]
        return removed

    def evict_order(
        self, num_tokens: int, shares: TenantShares | None = None
    ) -> Iterator[tuple[RadixNode, int]]:
        """Unlocked leaves, least recently used first, each with how many of its last tokens
        (whole pages) to trim, until ``num_tokens`` are trimmed or nothing is left to trim.

        With ``shares`` (fair eviction, ``pd.cache.tenants``), each leaf comes from the tenant
        that holds the most tokens of the tree per unit of its weight (ties: the larger tenant
        name), its own least recent leaf, trimmed no further than that tenant stays the most; without, one order over all tenants (global LRU).
        The caller trims each (``trim_leaf(node, take)``) before asking for the next; a parent
        whose last child was trimmed away becomes a leaf and joins the order (its tenant's).
        """
        ps = self.page_size
        heaps: dict[str, list[tuple[int, int, RadixNode]]] = {}
        usage: dict[str, int] = {}
        for i, node in enumerate(self.iter_nodes()):
            tenant = "" if shares is None else tenant_of(node.namespace)
            usage[tenant] = usage.get(tenant, 0) + len(node.key)
            if not node.children and node.lock_ref == 0:
                heaps.setdefault(tenant, []).append((node.last_access, i, node))
        tiebreak = sum(len(heap) for heap in heaps.values())
        for heap in heaps.values():
            heapq.heapify(heap)
        trimmed = 0
        while trimmed < num_tokens and heaps:
            tenant = "" if shares is None else _most_over(usage, heaps, shares)
            heap = heaps[tenant]
            _, order, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            wanted = num_tokens - trimmed
            take = min(len(node.key), wanted + (-wanted) % ps)
            if shares is not None:  # no page past the point where another tenant is more over
                take = _fair_take(usage, heaps, shares, tenant, take, ps)
            yield node, take
            trimmed += take
            usage[tenant] -= take
            if node.parent is not None:  # trimmed in part: the rest is still its tenant's LRU
                heapq.heappush(heap, (node.last_access, order, node))
            elif not parent.is_root and not parent.children:
                if parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.last_access, tiebreak, parent))
                    tiebreak += 1
            if not heap:
                del heaps[tenant]

    def held_len(self, tokens: Sequence[int], namespace: str = "") -> int:
        """How many leading tokens of ``tokens`` the tree holds, in whole pages (read-only:
        nothing is split or touched)."""
        key = tuple(tokens)
        ps = self.page_size
        node = self.roots.get(namespace)
        pos = 0
        while node is not None and pos + ps <= len(key):
            child = node.children.get(key[pos : pos + ps])
            if child is None:
                break
            common = self._common_len(child.key, key, pos)
            pos += common
            node = child if common == len(child.key) else None
        return pos

    def path_tokens(self, node: RadixNode) -> list[int]:
        """The full token path from the namespace root to the end of ``node``."""
        keys: list[tuple[int, ...]] = []
        cur: RadixNode | None = node
        while cur is not None:
            keys.append(cur.key)
            cur = cur.parent
        return [t for key in reversed(keys) for t in key]

    def path_values(self, node: RadixNode) -> list[int]:
        """The values from the namespace root to the end of ``node``."""
        parts: list[list[int]] = []
        cur: RadixNode | None = node
        while cur is not None:
            if cur.value is not None:
                parts.append(cur.value)
            cur = cur.parent
        return [v for part in reversed(parts) for v in part]

    def iter_nodes(self) -> Iterator[RadixNode]:
        """Every non-root node, parents before children."""
        stack = [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_integrity(self) -> None:
        """Shape invariants: keys are whole pages, children keyed by their first page, parents
        and namespaces consistent, values aligned with keys."""
        ps = self.page_size
        for namespace, root in self.roots.items():
            assert root.is_root and root.namespace == namespace, f"bad root {root}"
        for node in self.iter_nodes():
            parent = node.parent
            assert parent is not None, f"attached node without parent {node}"
            assert node.key, "node with an empty key below the root"
            assert len(node.key) % ps == 0, f"node of {len(node.key)} tokens, page {ps}"
            assert parent.children.get(node.key[:ps]) is node, "child not keyed by its first page"
            assert node.namespace == parent.namespace, "namespace differs from parent's"
            assert node.value is None or len(node.value) == len(node.key), (
                f"{len(node.value)} values for {len(node.key)} tokens"
            )

    def _walk(self, key: tuple[int, ...], namespace: str) -> TreeMatch:
        """Follow ``key`` page by page from the root of ``namespace`` as far as the tree holds
        it, touching each node passed (``last_access = clock``) and collecting its values.

        Where the key diverges or ends inside a node, that node is split, so the returned
        node ends exactly at the returned length; the next probe then finds no child and stops.
        """
        ps = self.page_size
        node = self.root(namespace)
        pos = 0
        values: list[int] = []
        while pos + ps <= len(key):
            child = node.children.get(key[pos : pos + ps])
            if child is None:
                break
            common = self._common_len(child.key, key, pos)
            if common < len(child.key):
                child = self.split(child, common)
            child.last_access = self.clock
            if child.value is not None:
                values.extend(child.value)
            pos += common
            node = child
        return TreeMatch(node, pos, values)

    def _common_len(self, key: tuple[int, ...], tokens: tuple[int, ...], pos: int) -> int:
        """Leading tokens of ``key`` equal to ``tokens[pos:]``, rounded down to whole pages."""
        n = min(len(key), len(tokens) - pos)
        if key[:n] == tokens[pos : pos + n]:  # the common case: the whole edge matches
            i = n
        else:
            i = next(j for j in range(n) if key[j] != tokens[pos + j])
        return i - i % self.page_size


_Heaps = dict[str, list[tuple[int, int, RadixNode]]]


def _most_over(usage: dict[str, int], heaps: _Heaps, shares: TenantShares) -> str:
    """The tenant with an evictable leaf that holds the most tokens per unit of its weight
    (ties: the larger name, so the order is deterministic)."""
    return max(heaps, key=lambda t: (usage[t] / shares.weight(t), t))


def _fair_take(
    usage: dict[str, int], heaps: _Heaps, shares: TenantShares, tenant: str, take: int, ps: int
) -> int:
    """The pages of ``take`` to trim from ``tenant``'s leaf before another tenant is the most
    over its share (at least one page): page by page, as if each were chosen on its own."""
    others = [(usage[t] / shares.weight(t), t) for t in heaps if t != tenant]
    if not others:
        return take
    runner_up, weight = max(others), shares.weight(tenant)
    n = ps
    while n < take and ((usage[tenant] - n) / weight, tenant) > runner_up:
        n += ps
    return n
