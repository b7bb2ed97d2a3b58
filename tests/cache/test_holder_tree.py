"""HolderTree: one tree for many nodes' paths, cut only where their holdings differ."""

from __future__ import annotations

import pytest

from pd.cache.holder_tree import HolderTree, encode_tokens
from pd.cache.prefix_index import PrefixMatch

A, B = 1, 2  # two nodes' bits


def _key(*tokens: int) -> bytes:
    return encode_tokens(tokens)


def _tokens(key: bytes) -> tuple[int, ...]:
    return tuple(int.from_bytes(key[i : i + 4], "little") for i in range(0, len(key), 4))


def _held_len(tree: HolderTree, bit: int, key: bytes, namespace: str = "") -> int:
    return PrefixMatch(tree.walk(key, namespace), [], 0).held_len(bit)


def _shape(tree: HolderTree) -> set[tuple[str, tuple[int, ...], int, tuple]]:
    """Every edge as (namespace, path tokens, held, pending counts)."""
    tree.check_integrity()
    return {
        (ns, _tokens(path), held, tuple(sorted(pending.items())))
        for ns, path, held, pending in tree.iter_edges()
    }


@pytest.mark.timeout(10)
def test_edges_split_where_holdings_differ_and_merge_back() -> None:
    tree = HolderTree(page_size=2)
    assert tree.insert(A, _key(1, 1, 2, 2, 3, 3)) == 6
    assert tree.insert(B, _key(1, 1, 2, 2)) == 4
    assert tree.insert(B, _key(1, 1, 9, 9)) == 2
    assert _shape(tree) == {
        ("", (1, 1), A | B, ()),
        ("", (1, 1, 2, 2), A | B, ()),
        ("", (1, 1, 2, 2, 3, 3), A, ()),
        ("", (1, 1, 9, 9), B, ()),
    }
    query = _key(1, 1, 2, 2, 3, 3, 4)  # the odd token is never matched (whole pages only)
    assert [_held_len(tree, bit, query) for bit in (A, B)] == [6, 4]
    assert tree.walk(query) == [(A | B, 0, 2), (A | B, 0, 4), (A, 0, 6)]
    assert _held_len(tree, A, _key(1, 1, 2, 7)) == 2  # diverges inside a page
    assert tree.insert(A, _key(1, 1, 2, 2)) == 0  # already held
    # B drops its [9, 9] page, then all it holds: what is left is A's single path again.
    tree.remove_suffix(B, _key(1, 1, 9, 9), "", 2)
    assert _shape(tree) == {("", (1, 1, 2, 2), A | B, ()), ("", (1, 1, 2, 2, 3, 3), A, ())}
    tree.remove_suffix(B, _key(1, 1, 2, 2), "", 4)
    assert _shape(tree) == {("", (1, 1, 2, 2, 3, 3), A, ())}
    tree.remove_suffix(A, _key(1, 1, 2, 2, 3, 3), "", 6)
    assert _shape(tree) == set()


@pytest.mark.timeout(10)
def test_namespaces_never_share_paths() -> None:
    tree = HolderTree()
    tree.insert(A, _key(5, 6), "t1")
    assert _held_len(tree, A, _key(5, 6), "t1") == 2
    assert _held_len(tree, A, _key(5, 6)) == 0 and tree.walk(_key(5, 6), "t2") == []


@pytest.mark.timeout(10)
def test_pending_prompts_are_counted_and_undone() -> None:
    tree = HolderTree(page_size=2)
    tree.insert(A, _key(1, 1, 2, 2))
    tree.add_pending(B, _key(1, 1, 2, 2, 3, 3))
    tree.add_pending(B, _key(1, 1, 2, 2, 3, 3))
    tree.add_pending(B, _key(1, 1))
    assert tree.walk(_key(1, 1, 2, 2, 3, 3)) == [(A, B, 2), (A, B, 4), (0, B, 6)]
    assert _held_len(tree, B, _key(1, 1, 2, 2, 3, 3)) == 0  # pending is not held
    assert tree.pending_paths() == {
        (B, "", _key(1, 1, 2, 2, 3, 3)): 2,
        (B, "", _key(1, 1)): 1,
    }
    assert ("", (1, 1), A, ((B, 3),)) in _shape(tree)
    tree.remove_pending(B, _key(1, 1))
    tree.remove_pending(B, _key(1, 1, 2, 2, 3, 3))
    tree.remove_pending(B, _key(1, 1, 2, 2, 3, 3))
    assert _shape(tree) == {("", (1, 1, 2, 2), A, ())}
    # Clearing a node's holdings keeps its pending prompts unless asked.
    tree.add_pending(A, _key(1, 1))
    tree.clear(A, pending=False)
    assert _shape(tree) == {("", (1, 1), 0, ((A, 1),))}
    tree.clear(A, pending=True)
    assert _shape(tree) == set()


@pytest.mark.timeout(10)
def test_bad_evictions_raise_and_change_nothing() -> None:
    tree = HolderTree(page_size=1)
    tree.insert(A, _key(1, 2, 3))
    tree.insert(A, _key(1, 2, 4))
    tree.insert(B, _key(1, 2, 3, 5))
    before = _shape(tree)
    with pytest.raises(ValueError, match="holds 3 of it"):
        tree.remove_suffix(A, _key(1, 2, 3, 5), "", 1)
    with pytest.raises(ValueError, match="holds 2 of it and more below"):
        tree.remove_suffix(A, _key(1, 2), "", 1)
    with pytest.raises(ValueError, match="run past a branch"):
        tree.remove_suffix(A, _key(1, 2, 3), "", 2)
    with pytest.raises(ValueError, match="evict 4 tokens of a 3-token path"):
        tree.remove_suffix(A, _key(1, 2, 3), "", 4)
    assert _shape(tree) == before
    with pytest.raises(ValueError, match="not whole pages of 2"):
        HolderTree(page_size=2).insert(A, _key(1, 2, 3))
    with pytest.raises(ValueError, match="token id -1"):
        encode_tokens([3, -1])
