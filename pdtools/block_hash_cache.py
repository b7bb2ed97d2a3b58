"""BlockHashCache: vLLM-style automatic prefix caching, kept ONLY as the benchmark baseline.

It models which blocks a block-hash cache would hold, to count hits at the same token capacity
as the RadixCache; it holds no KV. The scheme (as in vLLM's automatic prefix caching):

- a prompt is cut into full blocks of ``block_size`` tokens; block i's hash chains over the
  hash of block i-1, so a block is reusable only when its whole prefix matches too;
- a partial last block is never cached;
- a request takes a reference on each block it uses; at ref 0 a block joins the free queue
  (least recently freed first, a request's tail blocks ahead of its head blocks) and keeps its
  contents until an allocation pops it, which evicts its hash.

The hash is Python's ``hash`` over (parent hash, block tokens): a model, not a content address
(a 64-bit collision would only make the baseline look slightly better).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from pd.cache.base import CacheStats


class BlockMatch(NamedTuple):
    blocks: list[int]  # cached blocks of the matched prefix, in order
    num_tokens: int  # == len(blocks) * block_size


class BlockHashCache:
    """Hash-chained block cache of ``capacity_tokens // block_size`` blocks."""

    def __init__(self, capacity_tokens: int, block_size: int = 16) -> None:
        if capacity_tokens < block_size:
            raise ValueError(f"capacity {capacity_tokens} tokens < one block of {block_size}")
        self.block_size = block_size
        self.num_blocks = capacity_tokens // block_size
        self._ref = [0] * self.num_blocks
        self._hash: list[int | None] = [None] * self.num_blocks
        self._cached: dict[int, int] = {}  # hash -> block
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_blocks))
        self._num_hit = 0
        self._num_miss = 0
        self._num_evicted = 0

    @property
    def num_cached_tokens(self) -> int:
        return len(self._cached) * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def stats(self) -> CacheStats:
        return CacheStats(self._num_hit, self._num_miss, self._num_evicted)

    def match_prefix(self, tokens: Sequence[int], namespace: str = "") -> BlockMatch:
        """Longest chain of cached full blocks at the start of ``tokens`` (no references taken)."""
        blocks: list[int] = []
        for h in self._chain(tokens, namespace):
            block = self._cached.get(h)
            if block is None:
                break
            blocks.append(block)
        num_tokens = len(blocks) * self.block_size
        self._num_hit += num_tokens
        self._num_miss += len(tokens) - num_tokens
        return BlockMatch(blocks, num_tokens)

    def allocate(self, match: BlockMatch, num_tokens: int) -> list[int] | None:
        """Reference the matched blocks and take new ones up to ``num_tokens`` tokens.

        Returns the request's blocks, or None (and changes nothing) if they do not fit.
        """
        num_new = -(-num_tokens // self.block_size) - len(match.blocks)
        num_touched_free = sum(1 for b in match.blocks if self._ref[b] == 0)
        if num_new > len(self._free) - num_touched_free:
            return None
        for b in match.blocks:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
        blocks = list(match.blocks)
        for _ in range(num_new):
            b, _ = self._free.popitem(last=False)
            h = self._hash[b]
            if h is not None:  # evict the least recently freed cached block
                del self._cached[h]
                self._hash[b] = None
                self._num_evicted += self.block_size
            self._ref[b] = 1
            blocks.append(b)
        return blocks

    def free(self, tokens: Sequence[int], blocks: list[int], namespace: str = "") -> None:
        """A request finished: cache its full blocks (``tokens`` is what they hold), drop refs."""
        assert len(blocks) == -(-len(tokens) // self.block_size), (
            f"{len(blocks)} blocks for {len(tokens)} tokens"
        )
        for b, h in zip(blocks, self._chain(tokens, namespace)):
            if self._hash[b] is None and h not in self._cached:
                self._hash[b] = h
                self._cached[h] = b
        # Tail first: the deepest blocks are the least likely to be shared, so they go first.
        for b in reversed(blocks):
            self._ref[b] -= 1
            assert self._ref[b] >= 0, f"block {b} freed twice"
            if self._ref[b] == 0:
                self._free[b] = None

    def check_integrity(self) -> None:
        for b in range(self.num_blocks):
            assert (self._ref[b] == 0) == (b in self._free), f"block {b} ref {self._ref[b]}"
            h = self._hash[b]
            assert h is None or self._cached[h] == b, f"block {b} hash not indexed"
        assert len(self._cached) == sum(h is not None for h in self._hash), "stale hash index"

    def _chain(self, tokens: Sequence[int], namespace: str) -> Iterator[int]:
        """Hashes of the full blocks of ``tokens``, each chained over the one before."""
        bs = self.block_size
        h = hash(namespace)
        for i in range(0, len(tokens) - bs + 1, bs):
            h = hash((h, tuple(tokens[i : i + bs])))
            yield h
