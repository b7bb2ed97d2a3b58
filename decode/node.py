"""``DecodeRole``: a decode node receives prefilled requests' KV and decodes them with continuous batching.

The life of a request on a decode node (its scheduler is ``DecodeScheduler``):

1. ``DecodeReqMsg`` from the server -> ``EXPECTED`` (checked: a request that can never run is
   answered with an error at once). From here until it runs or ends, the request has one
   record in one owner, the scheduler's ``IncomingQueue`` (``decode.incoming``): the request,
   whose status says where it is, and its prefill node. A ``LocalReqMsg`` instead goes straight
   to the scheduler's ``waiting`` queue: this node prefills it itself (conditional
   disaggregation), in chunks interleaved with the running decodes, and streams every token,
   the first included; one with ``output_ids`` is a started request resumed here after its
   decode node died (failover): its prompt and that output are prefilled, then it streams on
   from that offset (``EngineCore.make_request``).
2. The prefill node's transfer request arrives (the queue is the transfer agent's slot owner).
   If it came before the server's ``DecodeReqMsg`` (two sockets, no order between them), the
   agent holds it until the queue knows the request, and this role has it answered as soon as
   the message is in (``answer_held``): the order costs no retry. Then ``reserve``
   (``INCOMING``): the cached prefix is locked and not sent again, slots for the rest are
   reserved, or "no room" and the sender retries.
3. The KV lands in those slots (``landed``); ``PrefilledMsg`` brings the first token (and
   its logprobs, when the request asked for them) ->
   ``admit`` -> ``running``, and the first token goes to the server: from here on the request
   has started (before, the server may re-route it when a node dies).
4. Decode, one token per step for the whole batch; every token goes to the server. A
   ``PauseMsg`` (its client fell behind) leaves it out of the steps, its KV kept, until the
   next one takes it back in (``Scheduler.set_paused``).
5. Finish (stop token, max_tokens, abort): the tokens and slots go to the prefix cache, so a
   follow-up turn of a conversation moves only its new tokens. A transfer that fails or times
   out releases its reservation (``release``, once no data thread can write into the slots) and
   the server hears of it; an ``abort`` is one call to the queue whatever the phase (one
   aborted while its KV lands is ``RELEASING`` until then, and the server hears nothing more).
6. The prefill node dies or leaves (``PeerGoneMsg``): its transfers are failed (step 5), and
   requests still expected from it, or whose KV came but whose first token never will, are
   freed and failed to the server (``forget_peer``). Requests already running are not touched.
"""

from __future__ import annotations

from decode.incoming import IncomingQueue, RecentAborts
from decode.scheduler import DecodeScheduler
from pd.core.messages import (
    AbortMsg,
    DecodeReqMsg,
    LocalReqMsg,
    NodeMsg,
    PauseMsg,
    PeerGoneMsg,
    PrefilledMsg,
    TokenMsg,
)
from pd.core.request import ReqStatus
from pd.engine.core import EngineCore
from pd.engine.scheduler import StepResult
from pd.engine.stats import TransferCounters
from pd.executor.sampler import skip_draws
from pd.node import BaseRole, NodeParts
from pd.node.links import PeerLinks, ServerLink


class DecodeRole(BaseRole):
    name = "decode"
    scheduler_cls = DecodeScheduler

    @classmethod
    def make_slot_owner(
        cls, core: EngineCore, server: ServerLink, peers: PeerLinks, addr: str
    ) -> IncomingQueue:
        assert isinstance(core.scheduler, DecodeScheduler)
        return core.scheduler.incoming

    def __init__(self, parts: NodeParts) -> None:
        self.parts = parts
        self.core = parts.core
        assert isinstance(self.core.scheduler, DecodeScheduler)
        self.scheduler: DecodeScheduler = self.core.scheduler
        self.incoming: IncomingQueue = self.scheduler.incoming
        self.transfer = parts.transfer
        self.server = parts.server
        self.recent_aborts = RecentAborts()  # aborts that came before their request

    # -- messages ---------------------------------------------------------------------------

    def handle(self, msg: NodeMsg) -> None:
        if isinstance(msg, DecodeReqMsg | LocalReqMsg):
            self._on_request(msg)
        elif isinstance(msg, PrefilledMsg):
            self._on_prefilled(msg)
        elif isinstance(msg, AbortMsg):
            self.abort(msg.request_id)
        elif isinstance(msg, PauseMsg):  # its client fell behind, or caught up
            self.scheduler.set_paused(msg.request_id, msg.is_paused)

    def _on_request(self, msg: DecodeReqMsg | LocalReqMsg) -> None:
        if self.recent_aborts.take(msg.request_id):
            return  # its abort overtook it (done at its first token on the prefill node)
        try:
            # a failover's output so far
            resumed = msg.output_ids if isinstance(msg, LocalReqMsg) else []
            req = self.core.make_request(
                msg.prompt_ids, msg.sampling, msg.request_id, msg.namespace, resumed
            )
            if isinstance(msg, LocalReqMsg):
                self.scheduler.add(req)
                return
            self.incoming.expect(req, msg.prefill_node)
        except ValueError as e:
            self.server.report_error(msg.request_id, str(e))
            return
        # a transfer request that came before this message is answered now, not after a step
        self.transfer.answer_held(msg.request_id)
        self._report_failed()

    def _on_prefilled(self, msg: PrefilledMsg) -> None:
        req = self.incoming.admit(msg.request_id, msg.first_token)
        if req is None:
            return  # aborted meanwhile: the abort freed (or will free) everything
        skip_draws(req.generator, 1)  # the prefill node drew the first token
        first_logprobs = [msg.first_logprobs] if msg.first_logprobs is not None else []
        req.output_logprobs = list(first_logprobs)  # in step with output_ids
        req.num_reported_cached_tokens = msg.num_cached_tokens
        self.server.send(
            TokenMsg(
                request_id=msg.request_id,
                offset=0,
                token_ids=[msg.first_token],
                logprobs=first_logprobs,
                finished=False,
                finish_reason=None,
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=msg.num_cached_tokens,  # the prefill node's hit
                node_id=self.parts.node_id,
            )
        )

    def forget_peer(self, msg: PeerGoneMsg) -> None:
        self._report_failed()  # its transfers, failed by the agent's close_peer
        for rid in self.incoming.forget_peer(msg.node_id):
            self.server.report_error(rid, f"prefill node {msg.node_id} is gone", can_retry=True)

    def abort(self, request_id: str) -> None:
        if self.incoming.abort(request_id, self.transfer):
            return
        if self.scheduler.abort(request_id) is None:  # not here yet, or not any more
            self.recent_aborts.add(request_id)

    def after_step(self, result: StepResult) -> None:
        self.server.report_step(result)
        self.transfer.progress()
        self._report_failed()

    def _report_failed(self) -> None:
        """Tell the server of the requests the transfer agent's calls failed."""
        for f in self.incoming.take_failed():
            self.server.report_error(f.request_id, f.error, can_retry=f.can_retry)

    # -- accounting -------------------------------------------------------------------------

    def transfer_counters(self) -> TransferCounters:
        return TransferCounters(num_transferring=len(self.incoming))

    def held_request_ids(self) -> set[str]:
        return set(self.incoming.ids(ReqStatus.EXPECTED, ReqStatus.INCOMING))
