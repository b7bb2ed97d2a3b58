"""``DecodeRole``: a decode node receives prefilled requests' KV and decodes them with continuous batching.

The life of a request on a decode node (its scheduler is ``DecodeScheduler``):

1. ``DecodeReqMsg`` from the server -> ``EXPECTED`` (checked: a request that can never run is
   answered with an error at once). From here until it runs or ends, the request has one
   record (``IncomingKV``): the request, whose status says where it is, and its prefill node. A ``LocalReqMsg`` instead goes straight to the scheduler's
   ``waiting`` queue: this node prefills it itself (conditional disaggregation), in chunks
   interleaved with the running decodes, and streams every token, the first included.
2. The prefill node's transfer request arrives -> ``reserve`` (the transfer agent asks this
   node's ``IncomingKV`` as its slot owner) -> ``DecodeScheduler.reserve_incoming``
   (``INCOMING``): the cached prefix is locked and not sent again, slots for the rest are
   reserved, or "no room" and the sender retries.
3. The KV lands in those slots; ``PrefilledMsg`` brings the first token ->
   ``admit_prefilled`` -> ``running``, and the first token goes to the server: from here on
   the request has started (before, the server may re-route it when a node dies).
4. Decode, one token per step for the whole batch; every token goes to the server.
5. Finish (stop token, max_tokens, abort): the tokens and slots go to the prefix cache, so a
   follow-up turn of a conversation moves only its new tokens. A transfer that fails or times
   out releases its reservation (``release``, once no data thread can write into the slots) and
   the server hears of it; one aborted while its KV lands is ``RELEASING`` until then, and the
   server hears nothing more of it.
6. The prefill node dies or leaves (``PeerGoneMsg``): its transfers are failed (step 5), and
   requests still expected from it, or whose KV came but whose first token never will, are
   freed and failed to the server. Requests already running are not touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from decode.scheduler import DecodeScheduler
from pd.core.messages import (
    AbortMsg,
    DecodeReqMsg,
    LocalReqMsg,
    NodeMsg,
    PeerGoneMsg,
    PrefilledMsg,
    TokenMsg,
)
from pd.core.request import Req, ReqStatus
from pd.engine.core import EngineCore, TransferCounters
from pd.engine.scheduler import StepResult
from pd.node import BaseRole, NodeParts
from pd.node.links import ServerLink
from transfer import BaseSlotOwner, KVPoll, SlotReservation


@dataclass
class _Incoming:
    req: Req  # EXPECTED, INCOMING or RELEASING (req.status)
    prefill_node: str


class IncomingKV(BaseSlotOwner):
    """Requests whose KV comes from a prefill node, from their announcement until they run or
    end: one record each. The scheduler holds the slots of those with a reservation; the
    transfer agent calls ``reserve`` and ``release`` (from the node's loop)."""

    def __init__(self, scheduler: DecodeScheduler, server: ServerLink) -> None:
        self._scheduler = scheduler
        self._server = server
        self._records: dict[str, _Incoming] = {}

    def __len__(self) -> int:
        return len(self._records)

    def expect(self, req: Req, prefill_node: str) -> None:
        self._scheduler.expect(req)
        self._records[req.request_id] = _Incoming(req, prefill_node)

    def get(self, request_id: str) -> _Incoming | None:
        return self._records.get(request_id)

    def pop(self, request_id: str) -> _Incoming | None:
        return self._records.pop(request_id, None)

    def ids(self, *statuses: ReqStatus, prefill_node: str | None = None) -> list[str]:
        """Requests in one of ``statuses`` (from ``prefill_node``, if given)."""
        return [
            rid
            for rid, rec in self._records.items()
            if rec.req.status in statuses and prefill_node in (None, rec.prefill_node)
        ]

    # -- BaseSlotOwner ----------------------------------------------------------------------

    def reserve(
        self, transfer_id: str, num_tokens: int, token_ids: Sequence[int] | None
    ) -> SlotReservation | None:
        rec = self._records.get(transfer_id)
        if rec is None or rec.req.status is not ReqStatus.EXPECTED:
            return None  # its DecodeReqMsg has not come yet: the sender asks again
        try:
            return self._scheduler.reserve_incoming(rec.req, num_tokens)
        except Exception as e:  # this request fails alone; the agent refuses its transfer
            del self._records[transfer_id]
            rec.req.fail(f"cannot receive its KV: {e}")
            self._server.report_error(transfer_id, f"cannot receive its KV: {e}")
            raise

    def release(self, transfer_id: str, reservation: SlotReservation) -> None:
        rec = self._records.pop(transfer_id, None)
        was_aborted = rec is not None and rec.req.status is ReqStatus.RELEASING
        self._scheduler.release_incoming(transfer_id)
        if not was_aborted:
            self._server.report_error(
                transfer_id, "KV transfer from the prefill node failed", can_retry=True
            )


class DecodeRole(BaseRole):
    name = "decode"
    scheduler_cls = DecodeScheduler

    @classmethod
    def make_slot_owner(cls, core: EngineCore, server: ServerLink) -> IncomingKV:
        assert isinstance(core.scheduler, DecodeScheduler)
        return IncomingKV(core.scheduler, server)

    def __init__(self, parts: NodeParts) -> None:
        self.parts = parts
        self.core = parts.core
        assert isinstance(self.core.scheduler, DecodeScheduler)
        assert isinstance(parts.slot_owner, IncomingKV)
        self.scheduler: DecodeScheduler = self.core.scheduler
        self.incoming: IncomingKV = parts.slot_owner
        self.server = parts.server

    # -- messages ---------------------------------------------------------------------------

    def handle(self, msg: NodeMsg) -> None:
        if isinstance(msg, DecodeReqMsg | LocalReqMsg):
            self._on_request(msg)
        elif isinstance(msg, PrefilledMsg):
            self._on_prefilled(msg)
        elif isinstance(msg, AbortMsg):
            self.abort(msg.request_id)

    def _on_request(self, msg: DecodeReqMsg | LocalReqMsg) -> None:
        try:
            req = self.core.make_request(
                msg.prompt_ids, msg.sampling, msg.request_id, msg.namespace
            )
            if isinstance(msg, LocalReqMsg):
                self.scheduler.add(req)
            else:
                self.incoming.expect(req, msg.prefill_node)
        except ValueError as e:
            self.server.report_error(msg.request_id, str(e))

    def _on_prefilled(self, msg: PrefilledMsg) -> None:
        if self.parts.transfer.poll(msg.request_id) != KVPoll.SUCCESS:
            return  # aborted meanwhile: the abort freed (or will free) everything
        req = self.scheduler.admit_prefilled(msg.request_id, msg.first_token)
        if req is None:
            return
        self.incoming.pop(msg.request_id)
        self.server.send(
            TokenMsg(
                request_id=msg.request_id,
                token_ids=[msg.first_token],
                finished=False,
                finish_reason=None,
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=msg.num_cached_tokens,  # the prefill node's hit
                node_id=self.parts.node_id,
            )
        )

    def forget_peer(self, msg: PeerGoneMsg) -> None:
        waiting = (ReqStatus.EXPECTED, ReqStatus.INCOMING)
        for rid in self.incoming.ids(*waiting, prefill_node=msg.node_id):
            rec = self.incoming.pop(rid)
            assert rec is not None
            if rec.req.status is ReqStatus.EXPECTED:
                rec.req.finish("abort")
            else:  # reserved: failed, or its KV is here
                if self.parts.transfer.poll(rid) not in (None, KVPoll.SUCCESS):
                    continue  # failed by close_peer: release() frees it and tells the server
                if self.scheduler.release_incoming(rid) is None:
                    continue
            self.server.report_error(rid, f"prefill node {msg.node_id} is gone", can_retry=True)

    def abort(self, request_id: str) -> None:
        rec = self.incoming.get(request_id)
        if rec is not None and rec.req.status is ReqStatus.RELEASING:
            return  # aborted before: release() frees it
        if rec is not None and rec.req.status is ReqStatus.EXPECTED:
            self.incoming.pop(request_id)
            rec.req.finish("abort")
            return
        state = self.parts.transfer.poll(request_id)
        if state is None or state == KVPoll.SUCCESS:  # nothing in flight: the slots are ours
            self.incoming.pop(request_id)
            if self.scheduler.release_incoming(request_id) is None:
                self.scheduler.abort(request_id)
        elif state == KVPoll.FAILED:  # release() frees it, and tells the server
            self.incoming.pop(request_id)
        else:  # the agent calls release() once no thread can write
            self.scheduler.abort_incoming(request_id)
            self.parts.transfer.receiver(request_id).abort("aborted by the server")

    def after_step(self, result: StepResult) -> None:
        self.server.report_step(result)
        self.parts.transfer.progress()

    # -- accounting -------------------------------------------------------------------------

    @property
    def num_expected(self) -> int:
        return len(self.incoming.ids(ReqStatus.EXPECTED))

    def transfer_counters(self) -> TransferCounters:
        return TransferCounters(num_transferring=self.num_expected + self.scheduler.num_incoming)

    def held_request_ids(self) -> set[str]:
        return set(self.incoming.ids(ReqStatus.EXPECTED, ReqStatus.INCOMING))
