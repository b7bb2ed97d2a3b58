"""``OutgoingQueue``: a prefill node's requests, each on its way to a decode node.

Every request on a prefill node leaves it for the decode node the coordinator chose. From its
arrival to its end here it has one record (``Outgoing``: the request, its route, its transfer)
and this queue is its one owner; the request's status says where it is (``pd.core.request``):

1. ``add``: the request arrived (``NEW`` while the node's ``PullSink`` holds it for a pull,
   then ``WAITING``/``RUNNING`` in the scheduler, which prefills it).
2. ``start``: the forward with its last chunk is about to run: its ``KVSender`` is on the record
   (the node made it), and sends each layer as the forward writes it.
3. The first token is sampled (``SENDING``: the scheduler keeps its slots, which the transfer
   reads); ``take_prefilled`` hands each such request out once (all its KV is in the pool).
4. ``take_ended``: its transfer is final; the node announces it (success: the first token to the
   decode node; failure: an error to the server). Mid-forward only successes are taken, and
   ``release_ended`` gives the slots back after the step, so nothing the forward may use
   changes under it: ``finish_sending``, the prompt goes into the cache, the record ends.
5. ``finish``: it ended at its first token (stop, max_tokens=1, a failure): its transfer, if
   any, is aborted and the record ends. ``abort``: the same from any phase, its slots back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from pd.core.request import Req, ReqStatus
from transfer.sender import KVSender
from transfer.state import KVPoll


class SentSlots(Protocol):
    """What the queue asks of the scheduler it is part of (``prefill.scheduler.PrefillScheduler``):
    the slots of a request that leaves it."""

    def release_sent(self, req: Req) -> None: ...

    def abort(self, request_id: str) -> Req | None: ...


class Route(NamedTuple):
    decode_addr: str  # the decode node's request socket (for PrefilledMsg and AbortMsg)
    decode_transfer_addr: str  # its transfer control endpoint


@dataclass(eq=False)
class Outgoing:
    req: Req
    route: Route
    sender: KVSender | None = None  # from the forward of its last chunk on
    started: float = 0.0  # when its transfer started
    computed: float = 0.0  # when its last layer's KV was in the pool (0: not yet)
    is_ended: bool = False  # its transfer is final and announced; its slots go back next


class OutgoingQueue:
    """The outgoing life of a prefill node's requests (module docstring). Part of
    ``PrefillScheduler`` (the slots of ``SENDING`` requests count there); everything is called
    on the node's loop thread."""

    def __init__(self, scheduler: SentSlots) -> None:
        self._scheduler = scheduler
        self._records: dict[str, Outgoing] = {}

    def __len__(self) -> int:
        return len(self._records)

    def get(self, request_id: str) -> Outgoing | None:
        return self._records.get(request_id)

    def ids(self, decode_addr: str | None = None) -> list[str]:
        """Requests here (routed to ``decode_addr``, if given)."""
        return [
            rid
            for rid, out in self._records.items()
            if decode_addr in (None, out.route.decode_addr)
        ]

    def sending(self) -> list[Req]:
        """Requests whose first token was sampled and whose transfer has not ended."""
        return [o.req for o in self._records.values() if o.req.status is ReqStatus.SENDING]

    @property
    def num_transferring(self) -> int:
        return sum(o.sender is not None and not o.is_ended for o in self._records.values())

    # -- the life of a request --------------------------------------------------------------

    def add(self, req: Req, route: Route) -> None:
        self._records[req.request_id] = Outgoing(req, route)

    def start(self, req: Req, sender: KVSender) -> None:
        """``req``'s transfer started (``sender``, to its route's decode node)."""
        out = self._records[req.request_id]
        out.sender, out.started = sender, time.monotonic()

    def take_prefilled(self) -> list[Outgoing]:
        """Requests that sampled their first token since the last call, their KV all in the
        pool now: each handed out once."""
        now = time.monotonic()
        done = [
            o
            for o in self._records.values()
            if o.req.status is ReqStatus.SENDING and not o.computed
        ]
        for out in done:
            out.computed = now
        return done

    def take_ended(self, mid_forward: bool) -> list[Outgoing]:
        """Requests whose transfer is final, each handed out once (the caller announces them);
        ``mid_forward``: only successes of requests whose KV was all computed."""
        ended = []
        for out in self._records.values():
            if out.is_ended or out.sender is None or (mid_forward and not out.computed):
                continue
            state = out.sender.poll()
            if state == KVPoll.SUCCESS or (state.is_final and not mid_forward):
                out.is_ended = True
                ended.append(out)
        return ended

    def release_ended(self) -> None:
        """After a step: the requests whose transfer ended give their slots back."""
        for rid in [rid for rid, o in self._records.items() if o.is_ended]:
            if self.finish_sending(rid) is None:  # not sending (it failed before its first token)
                del self._records[rid]

    def finish_sending(self, request_id: str) -> Req | None:
        """The request's transfer is over: its slots go back, its record ends. None if it is
        not sending."""
        out = self._records.get(request_id)
        if out is None or out.req.status is not ReqStatus.SENDING:
            return None
        del self._records[request_id]
        out.req.set_status(ReqStatus.FINISHED)  # here; it goes on on its decode node
        self._scheduler.release_sent(out.req)
        return out.req

    def finish(self, request_id: str, why: str) -> Route | None:
        """The request ended at its first token (or failed): its transfer, if any, is aborted
        and its record ends. Returns its route (its decode node may forget it), if it had one."""
        out = self._records.pop(request_id, None)
        if out is None:
            return None
        if out.sender is not None:
            out.sender.abort(why)
        return out.route

    def abort(self, request_id: str) -> bool:
        """Give the request up wherever it is here: its transfer is aborted, its slots go back,
        its record ends. False if it is not here. (A pull it is held for is ``PullSink``'s.)"""
        out = self._records.pop(request_id, None)
        if out is None:
            return False
        if out.sender is not None:
            out.sender.abort("aborted by the server")
        if out.req.status is ReqStatus.SENDING:
            out.req.finish("abort")
            self._scheduler.release_sent(out.req)
        else:  # waiting or running, or already finished
            self._scheduler.abort(request_id)
        return True
