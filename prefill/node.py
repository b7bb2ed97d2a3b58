"""``PrefillRole``: a prefill node prefills only what its RadixCache does not hold, then sends the KV.

The life of a request on a prefill node (its scheduler is ``PrefillScheduler``). From arrival
to end it has one record in one owner, the scheduler's ``OutgoingQueue`` (``prefill.outgoing``:
the request, whose status says where it is, its route and its transfer):

1. ``PrefillReqMsg`` arrives -> the scheduler's ``waiting`` queue (a request that can never
   run is answered with an error at once). One with ``pull`` set is first held by the
   ``PullSink`` until the prefix it names came from its holder into the cache, or will not
   come (then the prefix is computed): ``pd.node.pulls``.
2. Admission matches the prompt in the RadixCache and locks the match; the unmatched suffix
   is prefilled in chunks under the token budget.
3. When the batch with a request's last chunk is about to run, its transfer starts: a
   ``KVSender`` asks the decode node chosen by the coordinator for slots (that handshake
   overlaps the forward), and sends each layer's KV as soon as the forward has written it, so
   by the time the first token is sampled most of the KV is already across.
4. The first token is sampled (its logprobs too, if asked for: they travel with it). A
   request that ends there is answered to the server, released,
   its transfer aborted and its decode node told to forget it.
5. ``SENDING``: when its transfer ends, ``_announce`` (the one place that does it) tells the
   decode node on success (``PrefilledMsg``: it streams the first token itself, so a request
   has streamed nothing until it decodes and the server may re-route it if a node dies
   before), or the server on failure (an error it may retry). A success is announced as soon
   as the loop sees it, between the layers of the next forward if one runs
   (``between_layers``): the first tokens of a burst's first batch do not wait for the second
   batch's forward; between those layers the transfer agent moves on too, so a new pair
   group's rendezvous, handshakes and acknowledgements never wait for a forward of seconds.
   Either way the slots go back after the step (``release_ended``): the prompt goes into the
   cache, unlocked, and its cache events go to the server.
6. The decode node dies or leaves (``PeerGoneMsg``): every request routed to it is aborted
   here and failed to the server (which may re-route it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pd.core.messages import (
    AbortMsg,
    NodeMsg,
    PeerGoneMsg,
    PrefilledMsg,
    PrefillReqMsg,
    PullRefusedMsg,
)
from pd.core.request import Req
from pd.engine.core import EngineCore
from pd.engine.scheduler import ScheduledBatch, StepResult
from pd.engine.stats import TransferCounters
from pd.node import BaseRole, NodeParts
from pd.node.links import PeerLinks, ServerLink
from pd.node.pulls import PullSink
from prefill.outgoing import Outgoing, OutgoingQueue, Route
from prefill.scheduler import PrefillScheduler
from transfer.sender import KVSender
from transfer.state import KVPoll


class PrefillRole(BaseRole):
    name = "prefill"
    scheduler_cls = PrefillScheduler
    decodes = False  # a request leaves after its first token

    @classmethod
    def make_slot_owner(
        cls, core: EngineCore, server: ServerLink, peers: PeerLinks, addr: str
    ) -> PullSink:
        return PullSink(core, server, peers, addr)  # what a pull's KV lands in

    def __init__(self, parts: NodeParts) -> None:
        self.parts = parts
        self.core = parts.core
        assert isinstance(self.core.scheduler, PrefillScheduler)
        assert isinstance(parts.slot_owner, PullSink)
        self.scheduler: PrefillScheduler = self.core.scheduler
        self.outgoing: OutgoingQueue = self.scheduler.outgoing
        self.transfer = parts.transfer
        self.server = parts.server
        self.pulls: PullSink = parts.slot_owner
        self._counters = TransferCounters()  # finished transfers

    def handle(self, msg: NodeMsg) -> None:
        if isinstance(msg, PrefillReqMsg):
            self._on_request(msg)
        elif isinstance(msg, AbortMsg):
            self.abort(msg.request_id)
        elif isinstance(msg, PullRefusedMsg):
            self.pulls.on_refused(msg)

    def _on_request(self, msg: PrefillReqMsg) -> None:
        try:
            req = self.core.make_request(
                msg.prompt_ids, msg.sampling, msg.request_id, msg.namespace
            )
            if msg.pull is None:
                self.scheduler.add(req)
            else:  # scheduled once its prefix came, or will not (pd.node.pulls)
                self.pulls.start(req, msg.pull, self.transfer)
        except ValueError as e:
            self.server.report_error(msg.request_id, str(e))
            return
        self.outgoing.add(req, Route(msg.decode_addr, msg.decode_transfer_addr))

    def abort(self, request_id: str) -> None:
        self.pulls.abort(request_id, self.transfer)  # held for its pull: the pull goes too
        self.outgoing.abort(request_id)

    def forget_peer(self, msg: PeerGoneMsg) -> None:
        self.pulls.forget_holder(msg.node_id)  # its requests compute their prefix instead
        for rid in self.outgoing.ids(decode_addr=msg.addr):
            self.abort(rid)
            self.server.report_error(rid, f"decode node {msg.node_id} is gone", can_retry=True)

    def before_run(self, batch: ScheduledBatch) -> Callable[[int], None] | None:
        """Before a forward: start the transfer of each request whose last chunk it computes."""
        senders = []
        for req, seq in zip(batch.reqs[batch.num_decode :], batch.seqs[batch.num_decode :]):
            # max_tokens=1 ends at prefill: nothing to send (an EOS there aborts the transfer)
            if (
                seq.num_prefix + len(seq.new_token_ids) == req.fill_len
                and req.params.max_tokens > 1
            ):
                with self.parts.guard(req.request_id):
                    senders.append(self._start_transfer(req))
        if not senders:
            return None

        def on_layer_done(layer: int) -> None:
            for sender in senders:
                sender.set_ready_layers(layer + 1)

        return on_layer_done

    def _start_transfer(self, req: Req) -> KVSender:
        out = self.outgoing.get(req.request_id)
        assert out is not None, req.request_id
        route = out.route
        sender = self.transfer.sender(
            req.request_id, route.decode_transfer_addr, req.num_prompt_tokens, req.prompt_ids
        )
        self.outgoing.start(req, sender)
        sender.send(req.slots, num_ready_layers=0)
        return sender

    def after_step(self, result: StepResult) -> None:
        num_layers = self.core.runner.pool.num_layers
        for out in self.outgoing.take_prefilled():
            if out.sender is not None:
                out.sender.set_ready_layers(num_layers)
        # what a finished request left in the cache goes out before its answer
        self.server.send_all(self.core.cache.take_events())
        # the others' first token goes with their KV: the decode node streams it
        finished = [r for r in result.produced if r.is_finished]
        self.server.report_step(result._replace(produced=finished))
        for req in finished + result.failed:  # done at its first token: D can forget it
            self._forget(req.request_id, "finished at prefill")
        if len(self.outgoing):
            self.transfer.progress()
            self._announce(self.outgoing.take_ended(mid_forward=False))
        self.outgoing.release_ended()  # announced mid-forward too: no forward runs now
        for req in self.pulls.progress(self.transfer):  # its prefix came, or it computes it
            with self.parts.guard(req.request_id):
                self.scheduler.add(req)

    def _forget(self, request_id: str, why: str) -> None:
        route = self.outgoing.finish(request_id, why)
        if route is not None:
            self.parts.peers.send(route.decode_addr, AbortMsg(request_id=request_id, reason=why))

    def between_layers(self) -> None:
        """Mid-forward: the transfer agent moves on (a new pair group's rendezvous with a
        decode node, which must finish within ``connect_timeout_s`` however long this forward
        takes; handshakes; acknowledgements), and a transfer that ended since the step before
        is announced now (its first token to the decode node, which starts decoding it), not
        when this forward ends, seconds later on a CPU. Its slots go back after the step
        (``release_ended``): nothing the forward may use changes under it. Failures wait for
        the step's end too."""
        self.transfer.progress()
        self._announce(self.outgoing.take_ended(mid_forward=True))

    def _announce(self, ended: list[Outgoing]) -> None:
        """Transfers that ended: on success the decode node gets the first token, on failure
        the server an error it may retry."""
        for out in ended:
            with self.parts.guard(out.req.request_id):
                self._announce_one(out)

    def _announce_one(self, out: Outgoing) -> None:
        assert out.sender is not None
        rid = out.req.request_id
        if out.sender.poll() != KVPoll.SUCCESS:
            why = f"KV transfer to the decode node failed: {out.sender.failure}"
            self.server.report_error(rid, why, can_retry=True)
            return
        num_sent = out.req.num_prompt_tokens - out.sender.num_cached_tokens
        c, pool, now = self._counters, self.core.runner.pool, time.monotonic()
        self._counters = c._replace(
            num_bytes=c.num_bytes + num_sent * pool.num_bytes_per_token,
            num_seconds=c.num_seconds + now - out.started,
            num_wire_seconds=c.num_wire_seconds + now - (out.computed or out.started),
            num_done=c.num_done + 1,
        )
        first = PrefilledMsg(
            request_id=rid,
            first_token=out.req.output_ids[0],
            num_cached_tokens=out.req.num_cached_tokens,
            first_logprobs=out.req.output_logprobs[0] if out.req.output_logprobs else None,
        )
        self.parts.peers.send(out.route.decode_addr, first)

    def transfer_counters(self) -> TransferCounters:
        num_transferring = self.outgoing.num_transferring + len(self.pulls)
        return self._counters._replace(num_transferring=num_transferring)

    @property
    def num_expected(self) -> int:
        return len(self.pulls)  # held for their pull, not in the scheduler yet

    def held_request_ids(self) -> set[str]:
        return set(self.outgoing.ids())

    def stats_fields(self) -> dict[str, Any]:
        return self.pulls.stats_fields()
