"""``Drafter``: which decoding requests speculate, how many tokens each guesses, and how that
adapts to what was accepted (the guesses themselves: ``pd.executor.spec.propose`` and the prefix
cache's ``continuation``; their check: ``spec.verify`` in the runner).

The scheduler asks for a step's drafts (``drafts``) and reports each verdict (``verified``).
A draft's tokens are grown into the request's slots here, only into free ones: a guess never
evicts a cached prefix; the scheduler drops the slots of what was rejected."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from pd.cache.base import BasePrefixCache
from pd.core.kv_pool import SlotAllocator
from pd.core.request import Req
from pd.executor.spec import propose


class DraftStats(NamedTuple):
    num_steps: int  # decode rows that verified a draft ...
    num_draft_tokens: int  # ... the draft tokens they verified ...
    num_accepted_tokens: int  # ... and how many of those were accepted


class Drafter:
    def __init__(
        self,
        allocator: SlotAllocator,
        cache: BasePrefixCache,
        *,
        max_tokens: int,
        max_batch: int,
        max_model_len: int,
    ) -> None:
        """``max_tokens``: a draft's length at most (0: no speculation); ``max_batch``: steps
        of more decoding requests than this speculate not at all (past it, it costs)."""
        self.allocator = allocator
        self.cache = cache
        self.max_tokens = max_tokens
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self._stats = DraftStats(0, 0, 0)

    @property
    def stats(self) -> DraftStats:
        return self._stats

    def drafts(self, decoding: Sequence[Req]) -> list[list[int]]:
        """The speculative tokens of each of a step's decoding requests ([] where none)."""
        if not 0 < len(decoding) <= self.max_batch:
            return [[] for _ in decoding]
        return [self._draft(req) for req in decoding]

    def _draft(self, req: Req) -> list[int]:
        """First what followed the request's whole text in the prefix cache (the same
        conversation answered before, in its namespace), else ``spec.propose``: what followed
        the request's last few tokens earlier in its own prompt and output. No draft before
        ``min_tokens`` (the tokens banned until then are not applied to a draft), none past
        ``max_tokens`` or the context, and only into free slots."""
        p = req.params
        tokens = req.all_ids
        n = len(tokens)
        k = min(
            self._length(req), p.max_tokens - len(req.output_ids) - 1, self.max_model_len - n - 1
        )
        if k <= 0 or len(req.output_ids) < p.min_tokens:
            return []
        draft = self.cache.continuation(tokens, req.namespace, k) or propose(tokens, k)
        while draft and not self.allocator.can_extend(req.slots, n + len(draft)):
            draft.pop()
        self.allocator.extend(req.slots, n + len(draft))
        return draft

    def _length(self, req: Req) -> int:
        """The draft length ``req`` may have now (the maximum until it has adapted)."""
        return self.max_tokens if req.num_draft < 0 else req.num_draft

    def verified(self, req: Req, num_draft: int, num_accepted: int) -> None:
        """Count a verified draft, and size the request's next one: half as long after a draft
        with nothing accepted, up to the maximum again after one accepted whole."""
        s = self._stats
        self._stats = DraftStats(
            s.num_steps + 1, s.num_draft_tokens + num_draft, s.num_accepted_tokens + num_accepted
        )
        k = self._length(req)
        if num_accepted == 0:
            req.num_draft = max(1, k // 2)
        elif num_accepted == num_draft:
            req.num_draft = min(self.max_tokens, 2 * k)
