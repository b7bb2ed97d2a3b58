"""Continuous-batching scheduler over a paged KV pool and a prefix cache (plain Python).

The life of a request:

1. ``waiting``: FIFO. Admitted when the running set has room and its KV fits: the tokens it
   may still need (prompt + max_tokens, less the cached prefix) must fit in free + evictable
   slots after every running request's own outstanding need. Admission matches the prompt in the
   prefix cache and locks the match, so those slots cannot be evicted under it.
2. ``running`` and prefilling: the unmatched suffix is computed in chunks, at most
   ``max_prefill_tokens`` per step over all requests (chunked prefill).
3. ``running`` and decoding: one token per step, all decoding requests in one batch.
4. finished (stop token, max_tokens, max_model_len, abort): its tokens and slots are handed to
   the prefix cache, which keeps the page-aligned part and frees the rest.

A step prefills when any request is prefilling, else decodes (prefill-first, as SGLang).
Because admission reserves each request's worst case, a step never runs out of slots and no
running request is ever preempted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from pd.engine.batch import SeqInput
from pd.engine.kv_pool import SlotAllocator
from pd.engine.prefix_cache import BasePrefixCache
from pd.engine.request import Req


class ScheduledBatch(NamedTuple):
    reqs: list[Req]
    seqs: list[SeqInput]
    is_prefill: bool


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

    # -- queues -----------------------------------------------------------------------------

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
        pages = self.allocator.num_pages_for(req.max_len)
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
                self._release(req)
                self.running.remove(req)
                return req
        return None

    # -- schedule ---------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        self._admit()
        prefilling = [r for r in self.running if r.is_prefilling]
        if prefilling:
            return self._prefill_batch(prefilling)
        if self.running:
            return self._decode_batch()
        return None

    def _outstanding(self, req: Req) -> int:
        return self.allocator.num_new_pages(req.slots, req.max_len) * self.allocator.page_size

    def _admit(self) -> None:
        reserved = sum(self._outstanding(r) for r in self.running)
        while self.waiting and len(self.running) < self.max_running_requests:
            req = self.waiting[0]
            match = self.cache.match_prompt(req.prompt_ids, req.namespace)
            self.cache.inc_lock_ref(match.last_node)
            need = (
                self.allocator.num_pages_for(req.max_len) * self.allocator.page_size
                - match.num_tokens
            )
            available = self.allocator.num_free_slots + self.cache.num_evictable_tokens - reserved
            if need > available:
                self.cache.dec_lock_ref(match.last_node)
                break
            self.waiting.popleft()
            req.slots = list(match.slots)
            req.num_cached = match.num_tokens
            req.cache_node = match.last_node
            reserved += self._outstanding(req)
            self.running.append(req)

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

    def postprocess(self, batch: ScheduledBatch, next_tokens: Sequence[int]) -> list[Req]:
        """Record sampled tokens; return the requests that produced a token this step."""
        produced = []
        for req, token in zip(batch.reqs, next_tokens):
            if req.is_prefilling:  # a chunk that did not reach the end of the prompt
                continue
            req.output_ids.append(token)
            req.num_new_outputs += 1
            produced.append(req)
            req.finish_reason = self._finish_reason(req, token)
            if req.is_finished:
                self._release(req)
        self.running = [r for r in self.running if not r.is_finished]
        return produced

    def _finish_reason(self, req: Req, token: int) -> str | None:
        p = req.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if len(req.output_ids) >= p.max_tokens or len(req.all_ids) >= self.max_model_len:
            return "length"
        return None

    def _release(self, req: Req) -> None:
        tokens = req.all_ids[: req.num_computed]
        self.cache.cache_finished(tokens, req.slots, req.cache_node, req.namespace)
        req.slots = []
        req.cache_node = None

    def check_integrity(self) -> None:
        self.cache.check_integrity()
        self.cache.check_slot_ownership([(r.slots, r.cache_node) for r in self.running])
