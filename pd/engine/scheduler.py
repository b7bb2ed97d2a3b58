"""Continuous-batching scheduler over a paged KV pool and a prefix cache (plain Python).

The life of a request:

1. ``waiting``: in priority order, FIFO within one (``pd.core.priority``: lower
   ``params.priority`` first, none overtaken more than ``MAX_OVERTAKES`` times). Admitted when the running set has room and its KV is expected to fit:
   the tokens it is expected to need (``SlotBudget.expected_len``: its prompt, plus
   ``new_token_ratio`` of what it is expected to generate: at least 512 tokens, or as many as
   it generated already, at most its max_tokens; less the cached prefix) must fit in free + evictable
   slots after what every running request is expected to still take. Admission matches the
   prompt in the prefix cache and locks the match, so those slots cannot be evicted under it. A
   request whose grammar still compiles (off the loop thread: ``pd.executor.grammar``) is not
   admitted until it has compiled; others go ahead of it. A request that shares enough uncached
   tokens with a prompt still being prefilled here waits (``pd.engine.deferral``), and others go
   ahead of it, until that prompt is cached.
2. ``running`` and prefilling: the unmatched part is computed in chunks under a token budget
   (chunked prefill): ``max_prefill_tokens`` per step, or ``max_mixed_prefill_tokens`` in a step
   that also decodes, so running streams keep their pace.
3. ``running`` and decoding: one token per step; every decoding request is in every step but
   a paused one (``set_paused``: its client fell behind; it keeps its slots, and resumes with
   the tokens it would have made, each row being computed alone) and a decode node's request
   whose KV came while its grammar still compiles. At
   its first token the prompt goes into the prefix cache (locked while the request runs), so
   requests that share it match it while it decodes.
4. finished (stop token, max_tokens, max_model_len, abort, failure): its tokens and slots are
   handed to the prefix cache, which keeps the page-aligned part and frees the rest.

Retraction (admission is an estimate, so a step may find no room): before a step, if the running
requests' next tokens do not fit in free + evictable slots, the newest running request is
retracted: its KV goes into the prefix cache (unlocked), and it returns to the front of
``waiting`` with the tokens it has. When it is admitted again it matches its prompt and output so
far in the cache and recomputes only what was evicted, then samples its next token (``fill_len``
is then its whole history). ``new_token_ratio`` decays while nothing is retracted and goes back up
when something is, as in SGLang. With ``new_token_ratio=1`` admission reserves the worst case of
requests whose max_tokens is at most 512, and none of those is ever retracted; a longer answer is
expected to run as long again as it ran (a request without max_tokens is not booked for the
whole context), and retraction catches one that outruns that.

The scheduler decides who runs; its part ``slots`` (``pd.engine.slots.SlotBudget``) counts and
moves the requests' KV slots: the estimates above, growing, caching and releasing.

This class is the colocated engine's scheduler. The roles specialise it:
``prefill.scheduler.PrefillScheduler`` reserves only the prompt (``prompt_only``) and hands a
request off after its first token; ``decode.scheduler.DecodeScheduler`` also takes requests whose
prompt KV arrives from a prefill node (their promised slots count through ``num_promised``). Nodes
talk to a scheduler through its methods, never its fields.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from pd.cache.base import BasePrefixCache
from pd.core.batch import SeqInput
from pd.core.kv_pool import SlotAllocator
from pd.core.priority import insert_ranked
from pd.core.request import Req, ReqStatus
from pd.engine.deferral import pending_prompts, shares_pending_prompt
from pd.engine.drafter import Drafter
from pd.engine.slots import SlotBudget
from pd.executor.sampler import SampledRow

# A slot list held outside ``running`` and the prefix-cache node it has locked.
HeldSlots = tuple[list[int], Any]


class ScheduledBatch(NamedTuple):
    reqs: list[Req]  # decoding requests first, then prefill chunks
    seqs: list[SeqInput]  # one per request, but 1 + len(draft) one-token rows for a draft
    num_decode: int  # the first num_decode requests decode (one token each, or a draft)
    drafts: Sequence[list[int]] = ()  # per decoding request: its speculative tokens, or []

    @property
    def is_prefill(self) -> bool:
        return self.num_decode < len(self.reqs)


class StepResult(NamedTuple):
    produced: list[Req]  # requests that produced a token this step (some may be finished)
    failed: list[Req]  # requests that failed this step (``req.error`` says why), released
    num_scheduled: int = 0  # requests in the batch that ran (0: nothing to do)


class SchedulerStats(NamedTuple):
    num_waiting: int
    num_running: int
    num_queued_tokens: int  # tokens waiting or not yet computed (the router's load)
    num_prompt_tokens: int  # prompt tokens of every admitted request so far ...
    num_cached_tokens: int  # ... and how many of them the prefix cache served
    num_retracted: int  # retractions so far
    num_pauses: int  # requests paused so far (their client fell behind)
    num_spec_steps: int = 0  # decode rows that verified a draft ...
    num_draft_tokens: int = 0  # ... the draft tokens they verified ...
    num_accepted_tokens: int = 0  # ... and how many of those were accepted


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
        max_mixed_prefill_tokens: int | None = None,
        new_token_ratio: float = 1.0,
        num_speculative_tokens: int = 0,
        max_speculative_batch: int = 4,
        prompt_only: bool = False,
        num_promised: Callable[[], int] | None = None,
        is_ready: Callable[[Req], bool] | None = None,
    ) -> None:
        """``is_ready(req)``: whether ``req`` may run now (False while its grammar compiles,
        ``pd.executor.grammar.GrammarCompiler.prepare``); it keeps its place meanwhile."""
        self.slots = SlotBudget(
            allocator,
            cache,
            new_token_ratio=new_token_ratio,
            prompt_only=prompt_only,
            num_promised=num_promised,
        )
        self.allocator = allocator
        self.cache = cache
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.max_mixed_prefill_tokens = (
            max_prefill_tokens if max_mixed_prefill_tokens is None else max_mixed_prefill_tokens
        )
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self._is_ready = is_ready or (lambda req: True)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # in admission order: the newest last
        self._num_admitted_tokens = 0
        self._num_admitted_cached_tokens = 0
        self._num_retracted = 0
        self._num_pauses = 0
        self.drafter = Drafter(
            allocator,
            cache,
            max_tokens=num_speculative_tokens,
            max_batch=max_speculative_batch,
            max_model_len=max_model_len,
        )

    # -- requests in and out ----------------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def has_runnable(self) -> bool:
        """A request here that is not paused (else a step has nothing to do)."""
        return any(not r.is_paused for r in (*self.waiting, *self.running))

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
        pages = self.allocator.num_pages_for(self.slots.max_len(req))
        if pages > self.allocator.num_pages:
            raise ValueError(
                f"request needs {pages * self.allocator.page_size} KV slots, "
                f"the pool has {self.allocator.num_slots}"
            )

    def add(self, req: Req) -> None:
        self.check_request(req)
        req.set_status(ReqStatus.WAITING)
        insert_ranked(self.waiting, req)

    def abort(self, request_id: str) -> Req | None:
        """Remove a request wherever it is; its slots go to the cache/pool. None if unknown."""
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.finish("abort")
                return req
        for req in self.running:
            if req.request_id == request_id:
                self.running.remove(req)
                req.finish("abort")
                self.slots.release(req)
                return req
        return None

    def set_paused(self, request_id: str, is_paused: bool) -> bool:
        """Leave a request out of steps and admission, or take it back in; False if unknown."""
        for req in (*self.waiting, *self.running):
            if req.request_id == request_id:
                self._num_pauses += is_paused and not req.is_paused
                req.is_paused = is_paused
                return True
        return False

    def fail(self, req: Req, error: str, is_refused: bool = False) -> None:
        """``req`` failed (its forward, its sampling, its transfer): release what it holds
        (``is_refused``: its own fault, see ``Req.fail``)."""
        self.abort(req.request_id)
        req.fail(error, is_refused)

    # -- schedule ---------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        self._admit()
        # retract the newest running requests until every decoding one can take a token
        while self.running and not self.slots.can_decode(
            [r for r in self.running if not r.is_paused]
        ):
            self._retract(self.running[-1])
        decoding = [
            r for r in self.running if not r.is_prefilling and not r.is_paused and self._is_ready(r)
        ]
        reqs, seqs = [], []
        for req in decoding:
            self.slots.grow(req, req.num_computed + 1)
        drafts = self.drafter.drafts(decoding)
        for req, draft in zip(decoding, drafts):
            reqs.append(req)
            # its last token goes to position n - 1 and draft token i to n + i; the last row
            # attends to every slot (the list itself: no copy, as in a step without drafts)
            n = req.num_computed - len(draft)
            rows = [*req.all_ids[-1:], *draft]
            for i, token in enumerate(rows[:-1]):
                seqs.append(SeqInput([token], req.slots[: n + i], n - 1 + i))
            seqs.append(SeqInput(rows[-1:], req.slots, req.num_computed - 1))
        budget = self.max_mixed_prefill_tokens if decoding else self.max_prefill_tokens
        for req in [r for r in self.running if r.is_prefilling and not r.is_paused]:
            if budget <= 0:
                break
            start = req.num_computed
            n = self.slots.grow_upto(req, min(req.fill_len, start + budget)) - start
            if n <= 0:
                continue
            reqs.append(req)
            seqs.append(SeqInput(req.all_ids[start : start + n], req.slots, start))
            budget -= n
        if not reqs:
            self._retract_stalled()
            return None
        if decoding:
            self.slots.decay_ratio()
        return ScheduledBatch(reqs, seqs, len(decoding), drafts if any(drafts) else ())

    def _admit(self) -> None:
        deferred: list[Req] = []
        while self.waiting and len(self.running) < self.max_running_requests:
            req = self.waiting[0]
            if (
                req.is_paused
                or not self._is_ready(req)
                or shares_pending_prompt(req, self._pending_prompts(), self.cache)
            ):
                deferred.append(self.waiting.popleft())
                continue
            if not self._lock_prefix(req, self.slots.expected_len(req)):
                break
            self.waiting.popleft()
            req.set_status(ReqStatus.RUNNING)
            self.running.append(req)
        self.waiting.extendleft(reversed(deferred))

    def _lock_prefix(self, req: Req, expected_len: int) -> bool:
        """Match ``req``'s tokens in the cache and lock the match if ``expected_len`` tokens
        fit (free + evictable, after what others may take); False (nothing locked) if not."""
        tokens = req.all_ids[: req.fill_len]
        match = self.cache.match_prompt(tokens, req.namespace)
        self.cache.inc_lock_ref(match.last_node)
        need = self.allocator.num_pages_for(expected_len) * self.allocator.page_size
        if need - match.num_tokens > self.slots.num_available_tokens(self.running):
            self.cache.dec_lock_ref(match.last_node)
            return False
        req.slots = list(match.slots)
        req.cache_node = match.last_node
        req.num_admissions += 1
        if req.num_admissions == 1:
            req.num_cached_tokens = match.num_tokens
            self._num_admitted_tokens += req.num_prompt_tokens
            self._num_admitted_cached_tokens += match.num_tokens
        return True

    def _pending_prompts(self) -> list[tuple[str, list[int]]]:
        """(namespace, tokens) of prompts computed here that the cache will hold soon (a role
        adds its own)."""
        return pending_prompts(self.running)

    def _retract_stalled(self) -> None:
        """Nothing could run: requests are waiting on slots that only retraction frees."""
        active = [r for r in self.running if not r.is_paused]
        wants = active or any(not r.is_paused for r in self.waiting)
        if self.running and wants and all(r.is_prefilling for r in active):
            self._retract(self.running[-1])

    def _retract(self, req: Req) -> None:
        self.running.remove(req)
        self.slots.release(req)
        req.fill_len = len(req.all_ids)
        req.set_status(ReqStatus.WAITING)
        self.waiting.appendleft(req)
        self._num_retracted += 1
        self.slots.reset_ratio()

    # -- postprocess ------------------------------------------------------------------------

    def postprocess(self, batch: ScheduledBatch, rows: Sequence[SampledRow]) -> StepResult:
        """Record sampled tokens; a row whose sampling failed fails its request alone."""
        produced, failed = [], []
        for i, (req, row) in enumerate(zip(batch.reqs, rows)):
            if req.is_prefilling:  # a chunk that did not reach the end of what it fills
                continue
            draft = batch.drafts[i] if i < len(batch.drafts) else []
            if row.error is not None:
                self.fail(req, row.error, row.is_refused)
                failed.append(req)
                continue
            for j, token in enumerate((*row.accepted, row.token)):
                req.output_ids.append(token)
                if row.logprobs:
                    req.output_logprobs.append(row.logprobs[j])
                req.num_new_outputs += 1
                reason = _finish_reason(req, token, self.eos_token_ids, self.max_model_len)
                if reason is not None:
                    break
            if draft:
                self.drafter.verified(req, len(draft), len(row.accepted))
                # the KV of the draft tokens rejected (or past a stop) is dropped
                self.allocator.truncate(req.slots, len(req.all_ids) - 1)
            produced.append(req)
            if reason is not None:
                self.running.remove(req)
                req.finish(reason)
                self.slots.release(req)
            elif len(req.output_ids) == 1:
                self._on_first_token(req)
        return StepResult(produced, failed, len(batch.reqs))

    def fail_batch(self, batch: ScheduledBatch, error: str) -> list[Req]:
        """The forward of ``batch`` raised: fail its requests, so the next step cannot repeat it."""
        for req in batch.reqs:
            self.fail(req, error)
        return list(batch.reqs)

    def _on_first_token(self, req: Req) -> None:
        """A running request sampled its first token: its prompt goes into the prefix cache
        now, not when it finishes (a role may hand the request off here instead)."""
        self.slots.cache_prompt(req)

    # -- reporting --------------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        queued = sum(r.fill_len for r in self.waiting) + sum(
            r.fill_len - r.num_computed for r in self.running if r.is_prefilling
        )
        return SchedulerStats(
            len(self.waiting),
            len(self.running),
            queued,
            self._num_admitted_tokens,
            self._num_admitted_cached_tokens,
            self._num_retracted,
            self._num_pauses,
            *self.drafter.stats,
        )

    def held_slots(self) -> list[HeldSlots]:
        """Every slot list a request holds, with its locked cache node."""
        return [(r.slots, r.cache_node) for r in self.running]

    def check_integrity(self) -> None:
        """Cache invariants, and every slot free, cached, or held by exactly one request."""
        self.cache.check_integrity()
        self.cache.check_slot_ownership(self.held_slots())


def _finish_reason(
    req: Req, token: int, eos_token_ids: frozenset[int], max_model_len: int
) -> str | None:
    """Why ``req`` ends at ``token`` (just appended to its output), or None if it goes on."""
    p = req.params
    if (token in eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
        return "stop"
    if len(req.output_ids) >= p.max_tokens or len(req.all_ids) >= max_model_len:
        return "length"
    return None
