"""``DecodeNode``: receives prefilled requests' KV and decodes them with continuous batching.

The life of a request on a decode node (its scheduler is ``DecodeScheduler``):

1. ``DecodeReqMsg`` from the server -> ``expected`` (checked: a request that can never run is
   answered with an error at once). A ``LocalReqMsg`` instead goes straight to the scheduler's
   ``waiting`` queue: this node prefills it itself (conditional disaggregation), in chunks
   interleaved with the running decodes, and streams every token, the first included.
2. The prefill node's transfer request arrives -> ``reserve`` (the transfer agent asks this
   node as its slot owner) -> ``DecodeScheduler.reserve_incoming``: the cached prefix is locked
   and not sent again, slots for the rest are reserved, or "no room" and the sender retries.
3. The KV lands in those slots; ``PrefilledMsg`` brings the first token ->
   ``admit_prefilled`` -> ``running``, and the first token goes to the server: from here on
   the request has started (before, the server may re-route it when a node dies).
4. Decode, one token per step for the whole batch; every token goes to the server.
5. Finish (stop token, max_tokens, abort): the tokens and slots go to the prefix cache, so a
   follow-up turn of a conversation moves only its new tokens. A transfer that fails or times
   out releases its reservation (``release``, once no data thread can write into the slots) and
   the server hears of it.
6. The prefill node dies or leaves (``PeerGoneMsg``): its transfers are failed (step 5), and
   requests still expected from it, or whose KV came but whose first token never will, are
   freed and failed to the server. Requests already running are not touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from decode.scheduler import DecodeScheduler
from pd.core.messages import (
    AbortMsg,
    DecodeReqMsg,
    LocalReqMsg,
    PeerGoneMsg,
    PrefilledMsg,
    TokenMsg,
)
from pd.core.request import Req
from pd.engine.config import EngineConfig
from pd.engine.scheduler import StepResult
from pd.node import BaseNode, NodeConfig
from transfer import BaseSlotOwner, KVPoll, SlotReservation


class DecodeNode(BaseNode, BaseSlotOwner):
    role = "decode"
    scheduler_cls = DecodeScheduler

    def __init__(self, engine_cfg: EngineConfig, node_cfg: NodeConfig) -> None:
        super().__init__(engine_cfg, node_cfg, slot_owner=self)
        assert isinstance(self.core.scheduler, DecodeScheduler)
        self.decode_scheduler: DecodeScheduler = self.core.scheduler
        self._expected: dict[str, Req] = {}  # DecodeReqMsg seen, no reservation yet
        self._prefill_of: dict[str, str] = {}  # request -> its prefill node, until it runs
        self._aborted: set[str] = set()  # reservations being released after an abort

    # -- messages ---------------------------------------------------------------------------

    def _on_msg(self, msg: Any) -> None:
        if isinstance(msg, DecodeReqMsg | LocalReqMsg):
            self._on_request(msg)
        elif isinstance(msg, PrefilledMsg):
            self._on_prefilled(msg)
        elif isinstance(msg, AbortMsg):
            self._abort(msg.request_id)

    def _on_request(self, msg: DecodeReqMsg | LocalReqMsg) -> None:
        try:
            req = self.core.make_request(
                msg.prompt_ids, msg.sampling, msg.request_id, msg.namespace
            )
            if isinstance(msg, LocalReqMsg):
                self.scheduler.add(req)
                return
        except ValueError as e:
            self.report_error(msg.request_id, str(e))
            return
        self._expected[msg.request_id] = req
        self._prefill_of[msg.request_id] = msg.prefill_node

    def _on_prefilled(self, msg: PrefilledMsg) -> None:
        if self.transfer.poll(msg.request_id) != KVPoll.SUCCESS:
            return  # aborted meanwhile: the abort freed (or will free) everything
        req = self.decode_scheduler.admit_prefilled(msg.request_id, msg.first_token)
        if req is None:
            return
        self._prefill_of.pop(msg.request_id, None)
        n, cached = req.num_prompt_tokens, msg.num_cached_tokens  # the prefill node's hit
        self.send_server(
            TokenMsg(msg.request_id, [msg.first_token], False, None, n, cached, None, self.node_id)
        )

    def _forget_peer(self, msg: PeerGoneMsg) -> None:
        for rid in [r for r, p in self._prefill_of.items() if p == msg.node_id]:
            del self._prefill_of[rid]
            if self._expected.pop(rid, None) is None:  # reserved: failed, or its KV is here
                if self.transfer.poll(rid) not in (None, KVPoll.SUCCESS):
                    continue  # failed by close_peer: release() frees it and tells the server
                if self.decode_scheduler.release_incoming(rid) is None:
                    continue
            self.report_error(rid, f"prefill node {msg.node_id} is gone", can_retry=True)

    def _abort(self, request_id: str) -> None:
        self._prefill_of.pop(request_id, None)
        if self._expected.pop(request_id, None) is not None:
            return
        state = self.transfer.poll(request_id)
        if state is None or state == KVPoll.SUCCESS:  # nothing in flight: the slots are ours
            if self.decode_scheduler.release_incoming(request_id) is None:
                self.scheduler.abort(request_id)
        elif state != KVPoll.FAILED:  # the agent calls release() once no thread can write
            self._aborted.add(request_id)
            self.transfer.receiver(request_id).abort("aborted by the server")

    def _on_step(self, result: StepResult) -> None:
        self.report_step(result)

    # -- BaseSlotOwner: called by the transfer agent from this loop's progress() -------------

    def reserve(
        self, transfer_id: str, num_tokens: int, token_ids: Sequence[int] | None
    ) -> SlotReservation | None:
        req = self._expected.get(transfer_id)
        if req is None:
            return None  # its DecodeReqMsg has not come yet: the sender asks again
        try:
            reservation = self.decode_scheduler.reserve_incoming(req, num_tokens)
        except Exception as e:  # this request fails alone; the agent refuses its transfer
            self._abort(transfer_id)
            self.report_error(transfer_id, f"cannot receive its KV: {e}")
            raise
        if reservation is not None:
            del self._expected[transfer_id]
        return reservation

    def release(self, transfer_id: str, reservation: SlotReservation) -> None:
        self.decode_scheduler.release_incoming(transfer_id)
        self._prefill_of.pop(transfer_id, None)
        if transfer_id not in self._aborted:
            self.report_error(transfer_id, "KV transfer from the prefill node failed", True)
        self._aborted.discard(transfer_id)

    # -- accounting -------------------------------------------------------------------------

    def _num_transferring(self) -> int:
        return len(self._expected) + self.decode_scheduler.num_incoming

    def _num_expected(self) -> int:
        return len(self._expected)

    def _request_ids(self) -> set[str]:
        return super()._request_ids() | set(self._expected) | set(self._prefill_of)
