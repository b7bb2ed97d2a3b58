"""``DecodeScheduler``: the scheduler of a decode node.

On top of ``Scheduler``'s life (which a decode node runs whole for requests it prefills itself),
it takes requests whose prompt KV comes from a prefill node. Until they run, those live in its
``incoming`` queue (``decode.incoming.IncomingQueue``: one record each, every status move); the
scheduler does their slots:

1. ``reserve_incoming``: the longest prefix of the prompt this node still caches is locked and
   not sent again; if the request's expected length fits (the prompt + the estimated part of
   max_tokens; free + evictable, less what running requests and other reservations are expected
   to take), slots for the rest of the prompt are allocated and the remainder is promised (it
   counts against admission until the request runs). Else None ("no room").
2. ``admit_prefilled``: the KV is in and the first token came -> ``running`` (``RUNNING``), its
   prompt cached as a request prefilled here is at its first token, decoded with the rest (and,
   like any running request, retracted if the pool runs out: it then resumes here by
   recomputing what was evicted). The batch is bounded by the KV pool (step 1), not by
   ``max_running_requests``: refusing KV that fits would only make the prefill node's handshake
   time out.
3. ``release_incoming``: the KV will never arrive: the reserved slots go back to the pool and
   the cached prefix is unlocked.
"""

from __future__ import annotations

from typing import Any

from decode.incoming import IncomingQueue
from pd.core.request import Req, ReqStatus
from pd.engine.scheduler import HeldSlots, Scheduler
from transfer.state import SlotReservation


class DecodeScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, num_promised=lambda: self.incoming.num_promised, **kwargs)
        self.incoming = IncomingQueue(self)  # requests whose KV comes from a prefill node

    @property
    def num_unfinished(self) -> int:
        return super().num_unfinished + len(self.incoming)

    def reserve_incoming(self, req: Req, num_tokens: int) -> tuple[SlotReservation, int] | None:
        """Slots for the KV of ``req``'s prompt (see the module docstring) and the slots promised
        beyond them, or None for no room."""
        if num_tokens != req.num_prompt_tokens:
            raise ValueError(
                f"transfer of {num_tokens} tokens for a {req.num_prompt_tokens}-token prompt"
            )
        if req.slots:
            raise ValueError(f"request {req.request_id!r} already has a reservation")
        expected = self.slots.expected_len(req)
        if not self._lock_prefix(req, expected):
            return None
        self.slots.grow(req, num_tokens)
        page = self.allocator.page_size
        total = self.allocator.num_pages_for(expected) * page
        promised = total - self.allocator.num_pages_for(num_tokens) * page
        return SlotReservation(req.slots[req.num_cached_tokens :], req.num_cached_tokens), promised

    def admit_prefilled(self, req: Req, first_token: int) -> None:
        """The reserved slots hold the prompt's KV: decode from ``first_token`` on."""
        req.output_ids = [first_token]
        req.set_status(ReqStatus.RUNNING)
        self.running.append(req)
        self.slots.cache_prompt(req)  # the transfer is over: no one writes these slots any more

    def release_incoming(self, req: Req) -> None:
        """Free a reservation whose KV will never arrive (no data thread writes it)."""
        self.allocator.free(req.slots[req.num_cached_tokens :])  # the prefix stays cached
        self.cache.dec_lock_ref(req.cache_node)
        req.slots, req.cache_node = [], None

    def held_slots(self) -> list[HeldSlots]:
        return super().held_slots() + self.incoming.held_slots()
