"""``SlotBudget``: the scheduler's part that keeps a request's KV slots (plain Python).

It answers how many slots a request is expected to take (``expected_len``: its prompt, what it
has generated, and ``new_token_ratio`` of the tokens it is expected to generate yet,
``expected_new_tokens``) and how many a new request could still be promised
(``num_available_tokens``: free + evictable, less what running requests and the role's other
promises are expected to take yet), and it moves a request's slots: ``grow`` (evicting from the
prefix cache as needed), ``cache_prompt`` (the computed prompt into the cache while the request
runs) and ``release`` (everything to the cache, which keeps what it can). The scheduler decides
who runs; this part counts and moves slots.

``new_token_ratio`` decays while nothing is retracted (``decay_ratio``, once per decode step) and
goes back up when something is (``reset_ratio``), as in SGLang.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from pd.cache.base import BasePrefixCache
from pd.core.kv_pool import SlotAllocator
from pd.core.request import Req

# Admission estimates at most this many of a request's max_tokens (as SGLang): a chat request
# without max_tokens may ask for the whole context but rarely uses it.
CLIP_MAX_TOKENS_ESTIMATE = 4096
# An answer is expected to run at least this many tokens more, or as many more as it has run
# already, whichever is more (never past max_tokens): so a request without max_tokens (the
# server fills in the rest of the context) is booked for what its answer uses, not the context.
MIN_EXPECTED_NEW_TOKENS = 512
# new_token_ratio decays from its initial value to MIN_RATIO_FACTOR times it over DECAY_STEPS
# decode steps without a retraction.
MIN_RATIO_FACTOR = 0.2
DECAY_STEPS = 600


def expected_new_tokens(num_left: int, num_output: int) -> int:
    """Tokens a request that generated ``num_output`` and may generate ``num_left`` more is
    expected to generate yet: as many as it did, at least ``MIN_EXPECTED_NEW_TOKENS``, at most
    ``num_left``. The coordinator books this on a decode node (plus the prompt and the output),
    and the node's admission expects ``new_token_ratio`` of it, so the node never expects more
    than the coordinator booked; both grow as the answer grows."""
    return max(0, min(num_left, max(MIN_EXPECTED_NEW_TOKENS, num_output)))


class SlotBudget:
    """The KV slots of one scheduler's requests over its allocator and prefix cache.

    ``prompt_only``: a request is expected to take (and may hold) only its prompt's slots, as on
    a prefill node, which never decodes. ``num_promised``: slots promised outside the requests
    the scheduler passes in (a decode node's incoming reservations); called, not stored, so it
    is always current.
    """

    def __init__(
        self,
        allocator: SlotAllocator,
        cache: BasePrefixCache,
        *,
        new_token_ratio: float = 1.0,
        prompt_only: bool = False,
        num_promised: Callable[[], int] | None = None,
    ) -> None:
        if not 0.0 < new_token_ratio <= 1.0:
            raise ValueError(f"new_token_ratio must be in (0, 1], got {new_token_ratio}")
        self.allocator = allocator
        self.cache = cache
        self.prompt_only = prompt_only
        self._num_promised = num_promised
        self.init_new_token_ratio = self.new_token_ratio = new_token_ratio
        self._min_ratio = (
            new_token_ratio if new_token_ratio == 1.0 else new_token_ratio * MIN_RATIO_FACTOR
        )
        self._ratio_decay = (new_token_ratio - self._min_ratio) / DECAY_STEPS

    # -- estimates --------------------------------------------------------------------------

    def max_len(self, req: Req) -> int:
        """Tokens of KV the request may hold here at most."""
        return req.num_prompt_tokens if self.prompt_only else req.max_len

    def expected_len(self, req: Req) -> int:
        """Tokens of KV the request is expected to hold here at most (admission's estimate)."""
        if self.prompt_only:
            return req.num_prompt_tokens
        n = len(req.output_ids)
        left = expected_new_tokens(req.params.max_tokens - n, n)
        guess = math.ceil(min(left, CLIP_MAX_TOKENS_ESTIMATE) * self.new_token_ratio)
        return min(self.max_len(req), max(req.fill_len, req.num_computed) + guess)

    @property
    def num_room(self) -> int:
        """Slots that growing may take now: free + evictable."""
        return self.allocator.num_free_slots + self.cache.num_evictable_tokens

    def num_available_tokens(self, running: Sequence[Req]) -> int:
        """Slots a new request could still be promised: free + evictable, less what ``running``
        (and any other promise of the role's) are expected to take yet."""
        promised = self._num_promised() if self._num_promised is not None else 0
        reserved = sum(self._outstanding(r) for r in running) + promised
        return self.num_room - reserved

    def can_decode(self, running: Sequence[Req]) -> bool:
        """Every decoding request of ``running`` can take its next token's slot."""
        ps = self.allocator.page_size
        need = sum(
            self.allocator.num_new_pages(r.slots, r.num_computed + 1) * ps
            for r in running
            if not r.is_prefilling
        )
        return need <= self.num_room

    def decay_ratio(self) -> None:
        """A decode step ran without a retraction: expect a little less of every request."""
        self.new_token_ratio = max(self._min_ratio, self.new_token_ratio - self._ratio_decay)

    def reset_ratio(self) -> None:
        """A request was retracted: expect as much as at the start again."""
        self.new_token_ratio = self.init_new_token_ratio

    def _outstanding(self, req: Req) -> int:
        return (
            self.allocator.num_new_pages(req.slots, self.expected_len(req))
            * self.allocator.page_size
        )

    # -- moves ------------------------------------------------------------------------------

    def grow(self, req: Req, new_len: int) -> None:
        """Extend ``req.slots`` to ``new_len`` tokens, evicting from the cache as needed."""
        self.cache.make_room(
            self.allocator.num_new_pages(req.slots, new_len) * self.allocator.page_size
        )
        self.allocator.extend(req.slots, new_len)

    def grow_upto(self, req: Req, new_len: int) -> int:
        """Grow ``req.slots`` toward ``new_len`` as far as free + evictable slots allow."""
        ps = self.allocator.page_size
        own_tail = -len(req.slots) % ps  # free slots left in the request's last page
        new_len = min(new_len, len(req.slots) + own_tail + self.num_room // ps * ps)
        if new_len > len(req.slots):
            self.grow(req, new_len)
        return len(req.slots)

    def cache_prompt(self, req: Req) -> None:
        """Cache the request's computed tokens and keep running on the cache's slots for them
        (pages another request cached first are freed: no one but this node reads them)."""
        n = req.num_computed
        match = self.cache.cache_unfinished(
            req.all_ids[:n], req.slots, req.cache_node, req.namespace
        )
        req.slots, req.cache_node = match.slots, match.last_node

    def release(self, req: Req) -> None:
        """Hand a request's tokens and slots to the cache (it keeps what it can, frees the rest)."""
        self.allocator.truncate(req.slots, len(req.all_ids))  # a draft's slots, if any
        tokens = req.all_ids[: req.num_computed]
        self.cache.cache_finished(tokens, req.slots, req.cache_node, req.namespace)
        req.slots = []
        req.cache_node = None
