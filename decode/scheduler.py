"""``DecodeScheduler``: the scheduler of a decode node.

On top of ``Scheduler``'s life (which a decode node runs whole for requests it prefills itself),
a request whose prompt KV comes from a prefill node lives as:

0. ``expect``: the server announced it (``EXPECTED``); it holds nothing yet.
1. ``reserve_incoming`` (``INCOMING``): the longest prefix of the prompt this node still caches is locked and
   not sent again; if the request's expected length fits (the prompt + the estimated part of
   max_tokens; free + evictable, less what running requests and other reservations are expected
   to take), slots for the rest of the prompt are allocated and the remainder is promised. Else
   None ("no room"; the sender asks again).
2. ``incoming``: the KV lands in those slots (the node's transfer agent writes them).
3. ``admit_prefilled``: the first token arrives -> ``running`` (``RUNNING``) (its prompt cached, as a
   request prefilled here is at its first token), decoded with the rest (and, like
   any running request, retracted if the pool runs out: it then resumes here by recomputing
   what was evicted). The batch is bounded by the KV pool (step 1), not by
   ``max_running_requests``: refusing KV that fits would only make the prefill node's handshake
   time out.
4. ``release_incoming``: the transfer failed or was aborted (``abort_incoming`` marks it
   ``RELEASING`` until then): the reserved slots go back to the pool and the cached prefix is
   unlocked (``FINISHED``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from pd.core.request import Req, ReqStatus
from pd.engine.scheduler import HeldSlots, Scheduler
from transfer import SlotReservation


class _Incoming(NamedTuple):
    req: Req
    num_promised: int  # slots promised beyond the prompt's, until the request runs


class DecodeScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._incoming: dict[str, _Incoming] = {}

    @property
    def num_unfinished(self) -> int:
        return super().num_unfinished + len(self._incoming)

    @property
    def num_incoming(self) -> int:
        return len(self._incoming)

    def expect(self, req: Req) -> None:
        """``req``'s KV will come from a prefill node (checked: ValueError if it can never
        run here); ``reserve_incoming`` takes it when the sender asks."""
        self.check_request(req)
        req.set_status(ReqStatus.EXPECTED)

    def reserve_incoming(self, req: Req, num_tokens: int) -> SlotReservation | None:
        """Slots for the KV of ``req``'s prompt (see the module docstring), or None for no room."""
        if num_tokens != req.num_prompt_tokens:
            raise ValueError(
                f"transfer of {num_tokens} tokens for a {req.num_prompt_tokens}-token prompt"
            )
        if req.request_id in self._incoming:
            raise ValueError(f"request {req.request_id!r} already has a reservation")
        if req.status is not ReqStatus.EXPECTED:
            raise ValueError(f"request {req.request_id!r} is {req.status.value}, not expected")
        expected = self._expected_len(req)
        if not self._lock_prefix(req, expected):
            return None
        page = self.allocator.page_size
        self.cache.make_room(self.allocator.num_new_pages(req.slots, num_tokens) * page)
        self.allocator.extend(req.slots, num_tokens)
        total = self.allocator.num_pages_for(expected) * page
        promised = total - self.allocator.num_pages_for(num_tokens) * page
        req.set_status(ReqStatus.INCOMING)
        self._incoming[req.request_id] = _Incoming(req, promised)
        return SlotReservation(req.slots[req.num_cached_tokens :], req.num_cached_tokens)

    def admit_prefilled(self, request_id: str, first_token: int) -> Req | None:
        """The reserved slots hold the prompt's KV: decode from ``first_token`` on. None if
        there is no such reservation (released meanwhile)."""
        inc = self._incoming.pop(request_id, None)
        if inc is None:
            return None
        req = inc.req
        req.output_ids = [first_token]
        req.set_status(ReqStatus.RUNNING)
        self.running.append(req)
        self._cache_prompt(req)  # the transfer is over: no one writes these slots any more
        return req

    def abort_incoming(self, request_id: str) -> Req | None:
        """The request is aborted while its KV lands: ``RELEASING`` until ``release_incoming``
        (called once no data thread can write its slots). None if it has no reservation."""
        inc = self._incoming.get(request_id)
        if inc is None:
            return None
        inc.req.set_status(ReqStatus.RELEASING)
        return inc.req

    def release_incoming(self, request_id: str) -> Req | None:
        """Free a reservation whose KV will never arrive. None if there is none."""
        inc = self._incoming.pop(request_id, None)
        if inc is None:
            return None
        req = inc.req
        req.finish("abort")
        self.allocator.free(req.slots[req.num_cached_tokens :])  # the prefix stays cached
        self.cache.dec_lock_ref(req.cache_node)
        req.slots, req.cache_node = [], None
        return req

    def held_slots(self) -> list[HeldSlots]:
        incoming = [(i.req.slots, i.req.cache_node) for i in self._incoming.values()]
        return super().held_slots() + incoming

    def _num_promised(self) -> int:
        return sum(i.num_promised for i in self._incoming.values())
