"""``IncomingQueue``: a decode node's requests whose prompt KV comes from a prefill node.

From the server's announcement until they run or end, each has one record here (``Incoming``)
and this queue makes every move of its status (``pd.core.request``):

1. ``expect`` (the server's ``DecodeReqMsg``) -> ``EXPECTED``: checked (ValueError if it can
   never run here); it holds nothing. A transfer request that came first waits in the transfer
   agent (``knows`` says no until now), so it is never refused for want of this message.
2. ``reserve`` (the agent asks: this queue is the node's ``BaseSlotOwner``) -> ``INCOMING``: the
   scheduler locks the prefix it still caches and reserves slots for the rest, promising the
   room the request is expected to decode in (``DecodeScheduler.reserve_incoming``); or None,
   "no room", and the sender asks again. A reserve that raises fails that request alone.
3. ``landed`` (the agent): the KV is in its slots; the first token is on its way.
4. ``admit`` (the prefill node's ``PrefilledMsg``, with the first token) -> the scheduler's
   running batch (``RUNNING``); the record ends.
5. ``release`` (the agent: the transfer failed or timed out, and no data thread can write the
   slots any more) -> the slots go back (``FINISHED``) and the server hears of it
   (``take_failed``). ``abort`` is one call in any phase: expected -> finished; landed -> freed
   now; in flight -> ``RELEASING`` and the receive aborted, freed by its ``release`` (the server
   hears nothing more of it).
6. ``forget_peer`` (the prefill node is gone; the agent failed its transfers already): what was
   expected from it, or landed with a first token that will never come, is freed and failed;
   a transfer it failed is freed by ``release``.

An abort can overtake its request: the prefill node's ``AbortMsg`` for a request done at its
first token comes on another socket than the server's ``DecodeReqMsg``. ``RecentAborts``
remembers the ids an abort found nowhere, so the request that follows is dropped on arrival
instead of waiting as ``EXPECTED`` for KV that never comes.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from pd.core.request import Req, ReqStatus
from pd.engine.scheduler import HeldSlots
from transfer.agent import TransferAgent
from transfer.state import BaseSlotOwner, SlotReservation


class IncomingSlots(Protocol):
    """What the queue asks of the scheduler it is part of (``decode.scheduler.DecodeScheduler``):
    the checks and the slots of its requests."""

    def check_request(self, req: Req) -> None: ...

    def reserve_incoming(self, req: Req, num_tokens: int) -> tuple[SlotReservation, int] | None: ...

    def admit_prefilled(self, req: Req, first_token: int) -> None: ...

    def release_incoming(self, req: Req) -> None: ...


@dataclass(eq=False)
class Incoming:
    req: Req  # EXPECTED, INCOMING or RELEASING (req.status)
    prefill_node: str
    num_promised: int = 0  # slots promised beyond the prompt's, from reserve until it runs
    is_landed: bool = False  # INCOMING: the KV is in; no data thread writes the slots


class Failed(NamedTuple):
    """A request that failed inside a call of the transfer agent, for the server to hear."""

    request_id: str
    error: str
    can_retry: bool  # its transfer failed, not the request itself


class IncomingQueue(BaseSlotOwner):
    """The incoming phase of a decode node's requests (module docstring). Part of
    ``DecodeScheduler`` (its slots count there) and the slot owner of the node's transfer
    agent; everything is called on the node's loop thread."""

    def __init__(self, scheduler: IncomingSlots) -> None:
        self._scheduler = scheduler
        self._records: dict[str, Incoming] = {}
        self._failed: list[Failed] = []

    def __len__(self) -> int:
        return len(self._records)

    def ids(self, *statuses: ReqStatus) -> list[str]:
        """Requests in one of ``statuses`` (every request here if none is given)."""
        return [
            rid for rid, inc in self._records.items() if not statuses or inc.req.status in statuses
        ]

    @property
    def num_promised(self) -> int:
        return sum(inc.num_promised for inc in self._records.values())

    def held_slots(self) -> list[HeldSlots]:
        """The reserved slots of the requests here that have some, with the prefix each locked."""
        return [
            (inc.req.slots, inc.req.cache_node)
            for inc in self._records.values()
            if inc.req.status is not ReqStatus.EXPECTED
        ]

    def take_failed(self) -> list[Failed]:
        """Requests failed by ``reserve`` or ``release`` since the last call, each once."""
        failed, self._failed = self._failed, []
        return failed

    # -- the node's messages ----------------------------------------------------------------

    def expect(self, req: Req, prefill_node: str) -> None:
        """``req``'s KV will come from ``prefill_node`` (ValueError if it can never run here)."""
        self._scheduler.check_request(req)
        req.set_status(ReqStatus.EXPECTED)
        self._records[req.request_id] = Incoming(req, prefill_node)

    def admit(self, request_id: str, first_token: int) -> Req | None:
        """The request's KV is in and its first token came: it runs. None if it is not here
        with its KV landed (aborted meanwhile)."""
        inc = self._records.get(request_id)
        if inc is None or not inc.is_landed or inc.req.status is not ReqStatus.INCOMING:
            return None
        del self._records[request_id]
        self._scheduler.admit_prefilled(inc.req, first_token)
        return inc.req

    def abort(self, request_id: str, transfer: TransferAgent) -> bool:
        """Give the request up in whatever phase it is (module docstring, step 5); its slots go
        back now or, while its KV may still land, once no data thread can write them. False if
        it is not here."""
        inc = self._records.get(request_id)
        if inc is None:
            return False
        status = inc.req.status
        if status is ReqStatus.EXPECTED:
            del self._records[request_id]
            inc.req.finish("abort")
            # a transfer request held or still to come for it is refused at once
            transfer.receiver(request_id).abort("aborted by the server")
        elif status is ReqStatus.INCOMING and inc.is_landed:
            self._free(request_id)
        elif status is ReqStatus.INCOMING:
            inc.req.set_status(ReqStatus.RELEASING)
            transfer.receiver(request_id).abort("aborted by the server")  # then release()
        return True

    def forget_peer(self, prefill_node: str) -> list[str]:
        """``prefill_node`` is gone: free what was expected from it or landed from it (the
        agent failed its transfers in flight: ``release`` frees those). Returns the requests
        freed, for the server to hear of."""
        gone = []
        for rid, inc in list(self._records.items()):
            if inc.prefill_node != prefill_node:
                continue
            if inc.req.status is ReqStatus.EXPECTED:
                del self._records[rid]
                inc.req.finish("abort")
            elif inc.req.status is ReqStatus.INCOMING and inc.is_landed:
                self._free(rid)
            else:
                continue
            gone.append(rid)
        return gone

    # -- BaseSlotOwner: the transfer agent, from the node's loop -----------------------------

    def knows(self, transfer_id: str) -> bool:
        return transfer_id in self._records

    def reserve(
        self, transfer_id: str, num_tokens: int, token_ids: Sequence[int] | None
    ) -> SlotReservation | None:
        inc = self._records.get(transfer_id)
        if inc is None or inc.req.status is not ReqStatus.EXPECTED:
            raise ValueError(f"request {transfer_id!r} is not expected here")
        try:
            reserved = self._scheduler.reserve_incoming(inc.req, num_tokens)
        except Exception as e:  # this request fails alone; the agent refuses its transfer
            del self._records[transfer_id]
            inc.req.fail(f"cannot receive its KV: {e}")
            self._failed.append(Failed(transfer_id, f"cannot receive its KV: {e}", False))
            raise
        if reserved is None:
            return None
        reservation, inc.num_promised = reserved
        inc.req.set_status(ReqStatus.INCOMING)
        return reservation

    def landed(self, transfer_id: str) -> None:
        if (inc := self._records.get(transfer_id)) is not None:
            inc.is_landed = True

    def release(self, transfer_id: str, reservation: SlotReservation) -> None:
        inc = self._records.get(transfer_id)
        if inc is None:
            return
        was_aborted = inc.req.status is ReqStatus.RELEASING
        self._free(transfer_id)
        if not was_aborted:
            why = "KV transfer from the prefill node failed"
            self._failed.append(Failed(transfer_id, why, True))

    def _free(self, request_id: str) -> None:
        """A request with a reservation ends here: its slots go back, the record goes."""
        inc = self._records.pop(request_id)
        self._scheduler.release_incoming(inc.req)
        inc.req.finish("abort")


class RecentAborts:
    """Request ids an abort found nowhere, for ``max_age_s`` and at most ``max_ids`` of them
    (the oldest go first): bounded whatever a peer sends."""

    def __init__(
        self,
        max_ids: int = 4096,
        max_age_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_ids = max_ids
        self.max_age_s = max_age_s
        self._clock = clock
        self._ids: OrderedDict[str, float] = OrderedDict()  # id -> when, oldest first

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, request_id: str) -> None:
        now = self._clock()
        self._ids[request_id] = now
        self._ids.move_to_end(request_id)
        while self._ids and (
            len(self._ids) > self.max_ids or next(iter(self._ids.values())) < now - self.max_age_s
        ):
            self._ids.popitem(last=False)

    def take(self, request_id: str) -> bool:
        """Whether ``request_id`` was aborted before it came (forgotten now)."""
        when = self._ids.pop(request_id, None)
        return when is not None and when >= self._clock() - self.max_age_s
