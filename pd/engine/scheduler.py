"""Continuous-batching scheduler over a paged KV pool and a prefix cache (plain Python).

The life of a request:

1. ``waiting``: FIFO. Admitted when the running set has room and its KV fits: the tokens it
   may still need (``_reserve_len``: prompt + max_tokens, less the cached prefix) must fit in
   free + evictable slots after every running request's own outstanding need. Admission matches
   the prompt in the prefix cache and locks the match, so those slots cannot be evicted under it.
2. ``running`` and prefilling: the unmatched suffix is computed in chunks, at most
   ``max_prefill_tokens`` per step over all requests (chunked prefill).
3. ``running`` and decoding: one token per step, all decoding requests in one batch.
4. finished (stop token, max_tokens, max_model_len, abort, failure): its tokens and slots are
   handed to the prefix cache, which keeps the page-aligned part and frees the rest.

A step prefills when any request is prefilling, else decodes (prefill-first, as SGLang).
Because admission reserves each request's worst case, a step never runs out of slots and no
running request is ever preempted.

This class is the colocated engine's scheduler. The roles specialise it:
``prefill.scheduler.PrefillScheduler`` reserves only the prompt and hands a request off after its
first token; ``decode.scheduler.DecodeScheduler`` also takes requests whose prompt KV arrives from
a prefill node. Nodes talk to a scheduler through its methods, never its fields.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from pd.cache.base import BasePrefixCache
from pd.engine.batch import SeqInput
from pd.engine.kv_pool import SlotAllocator
from pd.engine.request import Req
from pd.engine.sampler import SampledRow

# A slot list held outside ``running`` and the prefix-cache node it has locked.
HeldSlots = tuple[list[int], Any]


class ScheduledBatch(NamedTuple):
    reqs: list[Req]
    seqs: list[SeqInput]
    is_prefill: bool


class StepResult(NamedTuple):
    produced: list[Req]  # requests that produced a token this step (some may be finished)
    failed: list[Req]  # requests that failed this step (``req.error`` says why), released
    num_scheduled: int = 0  # requests in the batch that ran (0: nothing to do)


class SchedulerStats(NamedTuple):
    num_waiting: int
    num_running: int
    num_queued_tokens: int  # prompt tokens waiting or not yet computed (the router's load)
    num_prompt_tokens: int  # prompt tokens of every admitted request so far ...
    num_cached_tokens: int  # ... and how many of them the prefix cache served


class Scheduler:
    def __init__(
        self,
        allocator: SlotAllocator,
        cache: BasePrefixCache,
        *,
        max_running_requests: int,
        max_prefill_tokens: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.allocator = allocator
        self.cache = cache
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self._num_admitted_tokens = 0
        self._num_admitted_cached_tokens = 0

    # -- requests in and out ----------------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def check_request(self, req: Req) -> None:
        """Raise ValueError (with the numbers) for a request this engine can never run."""
        n = req.num_prompt_tokens
        if n == 0:
            raise ValueError("prompt is empty")
        if n + req.params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({req.params.max_tokens}) = "
                f"{n + req.params.max_tokens} exceeds the context length ({self.max_model_len})"
            )
        pages = self.allocator.num_pages_for(self._reserve_len(req))
        if pages > self.allocator.num_pages:
            raise ValueError(
                f"request needs {pages * self.allocator.page_size} KV slots, "
                f"the pool has {self.allocator.num_slots}"
            )

    def add(self, req: Req) -> None:
        self.check_request(req)
        self.waiting.append(req)

    def abort(self, request_id: str) -> Req | None:
        """Remove a request wherever it is; its slots go to the cache/pool. None if unknown."""
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.finish_reason = "abort"
                return req
        for req in self.running:
            if req.request_id == request_id:
                req.finish_reason = "abort"
                self.running.remove(req)
                self._release(req)
                return req
        return None

    def fail(self, req: Req, error: str) -> None:
        """``req`` failed (its forward, its sampling, its transfer): release what it holds."""
        self.abort(req.request_id)
        req.fail(error)

    # -- schedule ---------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        self._admit()
        prefilling = [r for r in self.running if r.is_prefilling]
        if prefilling:
            return self._prefill_batch(prefilling)
        if self.running:
            return self._decode_batch()
        return None

    def num_available_tokens(self) -> int:
        """Slots a new request could still be promised: free + evictable, less what running
        requests (and any other promise of the role's) may yet take."""
        reserved = sum(self._outstanding(r) for r in self.running) + self._num_promised()
        return self.allocator.num_free_slots + self.cache.num_evictable_tokens - reserved

    def _reserve_len(self, req: Req) -> int:
        """Tokens of KV the request may hold here at most."""
        return req.max_len

    def _num_promised(self) -> int:
        """Slots promised outside ``running`` (a role's reservations)."""
        return 0

    def _outstanding(self, req: Req) -> int:
        return (
            self.allocator.num_new_pages(req.slots, self._reserve_len(req))
            * self.allocator.page_size
        )

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running_requests:
            req = self.waiting[0]
            if not self._lock_prefix(req, self._reserve_len(req)):
                break
            self.waiting.popleft()
            self.running.append(req)

    def _lock_prefix(self, req: Req, reserve_len: int) -> bool:
        """Match ``req``'s prompt in the cache and lock the match if ``reserve_len`` tokens fit
        (free + evictable, after what others may take); False (nothing locked) if not."""
        match = self.cache.match_prompt(req.prompt_ids, req.namespace)
        self.cache.inc_lock_ref(match.last_node)
        need = self.allocator.num_pages_for(reserve_len) * self.allocator.page_size
        if need - match.num_tokens > self.num_available_tokens():
            self.cache.dec_lock_ref(match.last_node)
            return False
        req.slots = list(match.slots)
        req.num_cached_tokens = match.num_tokens
        req.cache_node = match.last_node
        self._num_admitted_tokens += req.num_prompt_tokens
        self._num_admitted_cached_tokens += match.num_tokens
        return True

    def _grow(self, req: Req, new_len: int) -> None:
        self.cache.make_room(
            self.allocator.num_new_pages(req.slots, new_len) * self.allocator.page_size
        )
        self.allocator.extend(req.slots, new_len)

    def _prefill_batch(self, prefilling: Sequence[Req]) -> ScheduledBatch:
        budget = self.max_prefill_tokens
        reqs, seqs = [], []
        for req in prefilling:
            if budget == 0:
                break
            start = req.num_computed
            n = min(req.num_prompt_tokens - start, budget)
            self._grow(req, start + n)
            reqs.append(req)
            seqs.append(SeqInput(req.prompt_ids[start : start + n], req.slots, start))
            budget -= n
        return ScheduledBatch(reqs, seqs, is_prefill=True)

    def _decode_batch(self) -> ScheduledBatch:
        seqs = []
        for req in self.running:
            self._grow(req, req.num_computed + 1)
            seqs.append(SeqInput(req.all_ids[-1:], req.slots, req.num_computed - 1))
        return ScheduledBatch(list(self.running), seqs, is_prefill=False)

    # -- postprocess ------------------------------------------------------------------------

    def postprocess(self, batch: ScheduledBatch, rows: Sequence[SampledRow]) -> StepResult:
        """Record sampled tokens; a row whose sampling failed fails its request alone."""
        produced, failed = [], []
        for req, row in zip(batch.reqs, rows):
            if req.is_prefilling:  # a chunk that did not reach the end of the prompt
                continue
            if row.error is not None:
                self.fail(req, row.error)
                failed.append(req)
                continue
            req.output_ids.append(row.token)
            req.num_new_outputs += 1
            produced.append(req)
            req.finish_reason = self._finish_reason(req, row.token)
            if req.is_finished:
                self.running.remove(req)
                self._release(req)
            elif len(req.output_ids) == 1:
                self._on_first_token(req)
        return StepResult(produced, failed, len(batch.reqs))

    def fail_batch(self, batch: ScheduledBatch, error: str) -> list[Req]:
        """The forward of ``batch`` raised: fail its requests, so the next step cannot repeat it."""
        for req in batch.reqs:
            self.fail(req, error)
        return list(batch.reqs)

    def _on_first_token(self, req: Req) -> None:
        """A running request sampled its first token (a role may hand it off here)."""

    def _finish_reason(self, req: Req, token: int) -> str | None:
        p = req.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if len(req.output_ids) >= p.max_tokens or len(req.all_ids) >= self.max_model_len:
            return "length"
        return None

    def _release(self, req: Req) -> None:
        """Hand a request's tokens and slots to the cache (it keeps what it can, frees the rest)."""
        tokens = req.all_ids[: req.num_computed]
        self.cache.cache_finished(tokens, req.slots, req.cache_node, req.namespace)
        req.slots = []
        req.cache_node = None

    # -- reporting --------------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        queued = sum(r.num_prompt_tokens for r in self.waiting) + sum(
            r.num_prompt_tokens - r.num_computed for r in self.running if r.is_prefilling
        )
        return SchedulerStats(
            len(self.waiting),
            len(self.running),
            queued,
            self._num_admitted_tokens,
            self._num_admitted_cached_tokens,
        )

    def held_slots(self) -> list[HeldSlots]:
        """Every slot list a request holds, with its locked cache node."""
        return [(r.slots, r.cache_node) for r in self.running]

    def check_integrity(self) -> None:
        """Cache invariants, and every slot free, cached, or held by exactly one request."""
        self.cache.check_integrity()
        self.cache.check_slot_ownership(self.held_slots())
