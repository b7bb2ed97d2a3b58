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

Roles: ``colocated`` runs all four stages. ``prefill`` (a prefill node) reserves only the
prompt, and a request that has sampled its first token leaves ``running`` for ``prefilled``
with its slots still held, for the node to send. ``decode`` (a decode node) never prefills:
requests arrive through ``add_prefilled`` with their prompt KV already in their slots.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from pd.cache.base import BasePrefixCache
from pd.engine.batch import SeqInput
from pd.engine.kv_pool import SlotAllocator
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
        role: str = "colocated",
    ) -> None:
        if role not in ("colocated", "prefill", "decode"):
            raise ValueError(f"role must be colocated, prefill or decode, got {role!r}")
        self.role = role
        self.allocator = allocator
        self.cache = cache
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.prefilled: list[Req] = []  # prefill role: first token sampled, KV still held
        self.num_pending_reserved = 0  # decode role: slots promised to KV still arriving
        self.num_admitted_tokens = 0  # prompt tokens of admitted requests ...
        self.num_admitted_cached_tokens = 0  # ... and how many of them the cache served

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

    def _reserve_len(self, req: Req) -> int:
        return req.num_prompt_tokens if self.role == "prefill" else req.max_len

    def _outstanding(self, req: Req) -> int:
        return (
            self.allocator.num_new_pages(req.slots, self._reserve_len(req))
            * self.allocator.page_size
        )

    def num_available_tokens(self) -> int:
        """Slots a new request could still be promised: free + evictable, less what running
        requests (and KV still arriving) may yet take."""
        reserved = sum(self._outstanding(r) for r in self.running) + self.num_pending_reserved
        return self.allocator.num_free_slots + self.cache.num_evictable_tokens - reserved

    @property
    def num_queued_tokens(self) -> int:
        """Prompt tokens waiting or not yet computed (the load a router balances)."""
        waiting = sum(r.num_prompt_tokens for r in self.waiting)
        return waiting + sum(
            r.num_prompt_tokens - r.num_computed for r in self.running if r.is_prefilling
        )

    def add_prefilled(self, req: Req) -> None:
        """Decode role: ``req.slots`` hold its prompt's KV and ``output_ids`` its first token."""
        assert req.num_computed == req.num_prompt_tokens and len(req.output_ids) == 1
        self.running.append(req)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running_requests:
            req = self.waiting[0]
            match = self.cache.match_prompt(req.prompt_ids, req.namespace)
            self.cache.inc_lock_ref(match.last_node)
            need = self.allocator.num_pages_for(self._reserve_len(req)) * self.allocator.page_size
            if need - match.num_tokens > self.num_available_tokens():
                self.cache.dec_lock_ref(match.last_node)
                break
            self.waiting.popleft()
            req.slots = list(match.slots)
            req.num_cached = match.num_tokens
            req.cache_node = match.last_node
            self.num_admitted_tokens += req.num_prompt_tokens
            self.num_admitted_cached_tokens += match.num_tokens
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
            elif self.role == "prefill":
                self.prefilled.append(req)
        handed_off = {id(r) for r in self.prefilled}
        self.running = [r for r in self.running if not r.is_finished and id(r) not in handed_off]
        return produced

    def _finish_reason(self, req: Req, token: int) -> str | None:
        p = req.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if len(req.output_ids) >= p.max_tokens or len(req.all_ids) >= self.max_model_len:
            return "length"
        return None

    def release(self, req: Req) -> None:
        """Hand a request's tokens and slots to the cache (it keeps what it can, frees the rest)."""
        self._release(req)

    def _release(self, req: Req) -> None:
        tokens = req.all_ids[: req.num_computed]
        self.cache.cache_finished(tokens, req.slots, req.cache_node, req.namespace)
        req.slots = []
        req.cache_node = None

    def check_integrity(self, other_holders: Sequence[tuple[list[int], Any]] = ()) -> None:
        """Cache invariants, and every slot free, cached, or held by exactly one request
        (``other_holders``: slot lists a node holds outside the scheduler, with their locks)."""
        self.cache.check_integrity()
        held = [(r.slots, r.cache_node) for r in self.running + self.prefilled]
        self.cache.check_slot_ownership(held + list(other_holders))
