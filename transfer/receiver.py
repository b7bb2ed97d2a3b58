"""The receiving side (decode node): one record per transfer id, driven by ``progress()``.

A record's life is ``transfer.recv_record`` (``RecvStatus``: bootstrapping, held, waiting,
transferring, success, or failed once no worker job can still write into its slots); this side
answers the sender's messages, asks the slot owner for slots, and keeps one pair group worker
per sender group.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import torch

from transfer.control import ControlPlane
from transfer.datapath import NO_SEQ, DataJob, JobResult, KVLayout, PairWorker
from transfer.layout import MAX_SEGMENTS, WirePlan, in_wire_order
from transfer.messages import (
    NoRoomMsg,
    TransferAbortMsg,
    TransferDoneMsg,
    TransferReadyMsg,
    TransferRequestMsg,
    TransferStartMsg,
)
from transfer.pairs import sender_root
from transfer.recv_record import RecvRecord, RecvStatus
from transfer.state import (
    BaseSlotOwner,
    KVPoll,
    SlotReservation,
    TransferConfig,
    TransferHandle,
)

log = logging.getLogger(__name__)


class KVReceiver(TransferHandle["ReceiverSide", RecvRecord]):
    """Handle of one incoming transfer. Every method returns at once."""

    @property
    def slots(self) -> list[int]:
        """Destination slots of tokens ``[num_cached_tokens:]`` (the owner's after SUCCESS)."""
        return [] if self._rec.reservation is None else self._rec.reservation.slots

    @property
    def num_cached_tokens(self) -> int:
        return 0 if self._rec.reservation is None else self._rec.reservation.num_cached_tokens

    def abort(self, reason: str = "aborted by receiver") -> None:
        self._side.fail(self._rec, reason)


class ReceiverSide:
    def __init__(
        self,
        cfg: TransferConfig,
        ctrl: ControlPlane,
        layout: KVLayout,
        kind: str,
        owner: BaseSlotOwner | None,
        new_worker: Callable[[bytes, TransferRequestMsg], PairWorker],
    ) -> None:
        self._cfg, self._ctrl, self._layout, self._kind, self._owner = (
            cfg,
            ctrl,
            layout,
            kind,
            owner,
        )
        # (its sender's routing id, a request naming a new group) -> worker as rank 1
        self._new_worker = new_worker
        self._workers: dict[str, PairWorker] = {}  # group prefix -> pair
        self._newest_of_sender: dict[str, str] = {}  # a sender agent -> its newest group
        self._closed: dict[str, float] = {}  # sender_root -> until when its requests are refused
        self.records: dict[str, RecvRecord] = {}
        self.num_held = 0  # requests held (HELD) since the start, instead of refused

    def get(self, transfer_id: str) -> RecvRecord:
        if (rec := self.records.get(transfer_id)) is None:
            rec = self.records[transfer_id] = RecvRecord(transfer_id)
        return rec

    def fail(self, rec: RecvRecord, reason: str, notify: bool = True) -> None:
        if rec.state.is_final:
            return
        log.info("receive %s failed: %s", rec.transfer_id, reason)
        if notify and rec.identity is not None:
            worker = self._workers.get(rec.prefix)
            broken = worker is None or worker.is_broken
            self._ctrl.reply(rec.identity, _abort_msg(rec.transfer_id, reason, pair_broken=broken))
        rec.failure, rec.finished_at = reason, time.monotonic()
        if rec.job is not None and not rec.job.cancel():
            rec.move_to(RecvStatus.FAILING)  # the worker started it: release on its result
        else:  # no job, or queued and not started: it will only drain the stream
            self._release(rec)

    # -- progress

    def on_msg(self, identity: bytes, msg: object) -> None:
        if isinstance(msg, TransferRequestMsg):
            self._on_request(identity, msg)
            return
        rec = self.records.get(getattr(msg, "transfer_id", ""))
        if isinstance(msg, TransferStartMsg):
            self._on_start(identity, msg, rec)
        elif isinstance(msg, TransferAbortMsg) and rec is not None and rec.identity == identity:
            if msg.pair_broken:
                self._retire(rec.prefix, "the sender dropped the pair group")
            self.fail(rec, f"aborted by sender: {msg.reason}", notify=False)
        else:
            log.warning("receiver dropped %s from %s", type(msg).__name__, identity.hex())

    def on_result(self, res: JobResult) -> None:
        rec = self.records.get(res.job.transfer_id)
        if rec is None or rec.job is not res.job:
            return  # a drain job
        if res.error is None and rec.status == RecvStatus.TRANSFERRING:
            rec.move_to(RecvStatus.SUCCESS)
            rec.finished_at = time.monotonic()
            assert rec.identity is not None and self._owner is not None
            self._ctrl.reply(rec.identity, TransferDoneMsg(transfer_id=rec.transfer_id))
            self._owner.landed(rec.transfer_id)
        elif not rec.state.is_final:
            self.fail(rec, res.error or "cancelled")
            if rec.status == RecvStatus.FAILING:  # it waited for the job's result
                self._release(rec)
        else:  # failed earlier (deadline, abort); tell the sender if the pair died since
            if rec.status == RecvStatus.FAILING:
                self._release(rec)
            worker = self._workers.get(rec.prefix)
            if rec.identity is not None and (worker is None or worker.is_broken):
                self._ctrl.reply(rec.identity, _abort_msg(rec.transfer_id, "", pair_broken=True))
        self._drop_broken()

    def tick(self, now: float) -> None:
        for root in [r for r, until in self._closed.items() if until < now]:
            del self._closed[root]
        for rec in list(self.records.values()):
            if rec.state.is_final:
                if rec.status != RecvStatus.FAILING and now - rec.finished_at > self._cfg.linger_s:
                    del self.records[rec.transfer_id]
            elif rec.status == RecvStatus.HELD:
                self._serve_held(rec, now)
            elif now > rec.deadline:
                why = f"{rec.state.name.lower()} for over {self._cfg.timeout_s} s"
                if rec.status == RecvStatus.TRANSFERRING:  # the stream is stuck: drop the pair
                    self._retire(rec.prefix, f"pair stuck: {rec.transfer_id} {why}")
                self.fail(rec, why)
        self._drop_broken()

    @property
    def num_pairs(self) -> int:
        return len(self._workers)

    @property
    def num_open(self) -> int:
        """Transfers not yet final, and final ones whose slots still wait for a worker."""
        done = (RecvStatus.SUCCESS, RecvStatus.FAILED)
        return sum(r.status not in done for r in self.records.values())

    def answer_held(self, transfer_id: str) -> None:
        rec = self.records.get(transfer_id)
        if rec is not None and rec.status == RecvStatus.HELD:
            self._serve_held(rec, time.monotonic())

    def reopen_peer(self, endpoint: str) -> None:
        """A new sender at ``endpoint``: its requests are taken again."""
        self._closed.pop(sender_root(endpoint), None)

    def close_peer(self, endpoint: str) -> None:
        """The sender at ``endpoint`` is gone: fail its transfers (their slots are released once
        no worker writes into them), close its pair groups, and refuse its requests for
        ``linger_s`` (a sender that was only frozen must not open new ones)."""
        root = sender_root(endpoint)
        self._closed[root] = time.monotonic() + self._cfg.linger_s
        for prefix in [p for p in self._workers if p.startswith(root)]:
            self._retire(prefix, f"sender {endpoint} closed")
        for rec in list(self.records.values()):
            if rec.prefix.startswith(root):
                self.fail(rec, f"sender {endpoint} closed", notify=False)
        for sender, prefix in list(self._newest_of_sender.items()):
            if prefix.startswith(root):
                del self._newest_of_sender[sender]

    def close(self) -> None:
        for worker in self._workers.values():
            worker.close(join_timeout_s=1.0)
        self._workers.clear()

    # -- helpers

    def _on_request(self, identity: bytes, msg: TransferRequestMsg) -> None:
        rec = self.records.get(msg.transfer_id)
        if rec is not None and rec.status != RecvStatus.BOOTSTRAPPING:
            if rec.state == KVPoll.FAILED:  # FAILING or FAILED
                self._ctrl.reply(identity, _abort_msg(msg.transfer_id, rec.failure or ""))
            elif rec.identity == identity and rec.status == RecvStatus.WAITING:
                assert rec.reservation is not None  # a repeated request: answer the same
                self._ctrl.reply(identity, _ready_msg(msg.transfer_id, rec.reservation))
            return  # HELD: answered once the owner knows the id
        if (why := _refused(msg, self._closed, self._kind, self._layout)) is not None:
            log.warning("refused transfer %s: %s", msg.transfer_id, why)
            self._ctrl.reply(identity, _abort_msg(msg.transfer_id, why))
            return
        # start the rendezvous now, off the critical path: the sender's pair group (a new one
        # retires its older group)
        worker = self._workers.get(msg.group_prefix)
        if worker is None or worker.is_broken:
            sender = msg.group_prefix.rpartition("/")[0]  # kvx/{endpoint}/{agent}/{n}
            old = self._newest_of_sender.get(sender)
            if old is not None and old != msg.group_prefix:
                self._retire(old, "the sender moved on to a new pair group")
            self._workers[msg.group_prefix] = self._new_worker(identity, msg)
            self._newest_of_sender[sender] = msg.group_prefix
        if self._owner is not None and not self._owner.knows(msg.transfer_id):
            self._hold(identity, msg)
        else:
            self._reserve(identity, msg, None)

    def _hold(self, identity: bytes, msg: TransferRequestMsg) -> None:
        """The owner does not know the id yet: keep the request (``tick`` answers it), unless
        ``max_held_requests`` are held already (then "no room": the sender asks again)."""
        num_held = sum(r.status == RecvStatus.HELD for r in self.records.values())
        if num_held >= self._cfg.max_held_requests:
            self._ctrl.reply(identity, NoRoomMsg(transfer_id=msg.transfer_id))
            return
        # the sender hears an answer before its handshake timeout, so it never gives up the pair
        deadline = time.monotonic() + self._cfg.handshake_timeout_s / 2
        self.get(msg.transfer_id).hold(identity, msg, deadline)
        self.num_held += 1

    def _serve_held(self, rec: RecvRecord, now: float) -> None:
        """A HELD request: reserve once the owner knows its id; past its deadline, "no room"."""
        assert rec.identity is not None and rec.request is not None and self._owner is not None
        if self._owner.knows(rec.transfer_id):
            self._reserve(rec.identity, rec.request, rec)
        elif now > rec.deadline:
            rec.unhold()
            self._ctrl.reply(rec.identity, NoRoomMsg(transfer_id=rec.transfer_id))

    def _reserve(self, identity: bytes, msg: TransferRequestMsg, held: RecvRecord | None) -> None:
        """Ask the owner for slots and answer the sender (``held``: the request's HELD record)."""
        try:
            res = (
                self._owner.reserve(msg.transfer_id, msg.num_tokens, msg.token_ids)
                if self._owner
                else None
            )
            why = None if res is None else _bad_reservation(msg, res, self._layout.num_slots)
        except Exception as e:  # the owner failed this transfer alone: say so, keep going
            log.exception("slot owner failed to reserve for %s", msg.transfer_id)
            res, why = None, f"reserve failed: {e}"
        if why is not None:
            if res is not None:  # nothing writes into these slots yet: give them back
                assert self._owner is not None
                self._owner.release(msg.transfer_id, res)
            if held is None:
                self._ctrl.reply(identity, _abort_msg(msg.transfer_id, why))
            else:  # failed: a repeat of the request is refused the same
                self.fail(held, why)
            return
        if res is None:
            if held is not None:
                held.unhold()
            self._ctrl.reply(identity, NoRoomMsg(transfer_id=msg.transfer_id))
            return
        rec = held if held is not None else self.get(msg.transfer_id)
        rec.move_to(RecvStatus.WAITING)
        rec.identity, rec.prefix, rec.reservation = identity, msg.group_prefix, res
        rec.request, rec.deadline = None, time.monotonic() + self._cfg.timeout_s
        slots = torch.tensor(res.slots, dtype=torch.int64, device=self._layout.device)
        # its place in the stream (seq) and wire plan come with the start message
        rec.job = DataJob(transfer_id=msg.transfer_id, slots=slots, deadline=rec.deadline)
        self._ctrl.reply(identity, _ready_msg(msg.transfer_id, res))

    def _on_start(self, identity: bytes, msg: TransferStartMsg, rec: RecvRecord | None) -> None:
        worker = self._workers.get(msg.group_prefix)
        if worker is None:
            log.warning("start of %s names unknown group %s", msg.transfer_id, msg.group_prefix)
            return  # the sender's data times out and it rebuilds its pair
        if not (
            rec is not None
            and rec.identity == identity
            and rec.status == RecvStatus.WAITING
            and rec.prefix == msg.group_prefix
        ):
            rec = None  # failed or unknown here: still read the payload to keep the stream whole
        job = None if rec is None else rec.job
        n = None if job is None or job.slots is None else job.slots.numel()
        if (why := _bad_plan(msg, n)) is not None:  # nobody can read this stream in step
            self._retire(msg.group_prefix, f"start of {msg.transfer_id}: {why}")
            if rec is not None:
                self.fail(rec, why)
            return
        plan = WirePlan(msg.by_dst, list(msg.segments))
        if rec is None or job is None or job.slots is None:
            deadline = time.monotonic() + self._cfg.timeout_s
            drain = DataJob(
                transfer_id=msg.transfer_id, slots=None, deadline=deadline, seq=msg.seq, plan=plan
            )
            worker.submit(drain)
            return
        assert job.seq == NO_SEQ
        job.slots = in_wire_order(job.slots, job.slots, plan.by_dst)
        job.seq, job.plan = msg.seq, plan
        rec.move_to(RecvStatus.TRANSFERRING)
        worker.submit(job)

    def _release(self, rec: RecvRecord) -> None:
        """-> FAILED (once): give the reserved slots back; no worker can write into them."""
        rec.move_to(RecvStatus.FAILED)
        if rec.reservation is not None:
            assert self._owner is not None
            self._owner.release(rec.transfer_id, rec.reservation)

    def _drop_broken(self) -> None:
        for prefix, worker in list(self._workers.items()):
            if worker.is_broken:
                self._retire(prefix, "pair group broken")

    def _retire(self, prefix: str, reason: str) -> None:
        if (worker := self._workers.pop(prefix, None)) is not None:
            worker.close()
        for rec in self.records.values():
            if rec.prefix == prefix and rec.status in (RecvStatus.WAITING, RecvStatus.HELD):
                self.fail(rec, reason)


def _refused(msg: TransferRequestMsg, closed: Iterable[str], kind: str, lo: KVLayout) -> str | None:
    """Why a request cannot be served here: a closed sender (``closed``: the roots of senders
    refused), or a layout that differs from ``kind`` and ``lo``."""
    if any(msg.group_prefix.startswith(root) for root in closed):
        return "the sender was closed here"
    mine = (kind, lo.num_layers, lo.elems_per_token, lo.dtype_name)
    theirs = (msg.backend, msg.num_layers, msg.elems_per_token, msg.dtype)
    if mine != theirs:
        return f"layout (backend, layers, elems/token, dtype) {theirs} != receiver's {mine}"
    if msg.num_tokens < 1 or (msg.token_ids is not None and len(msg.token_ids) != msg.num_tokens):
        return f"bad num_tokens {msg.num_tokens}"
    return None


def _bad_reservation(msg: TransferRequestMsg, res: SlotReservation, num_slots: int) -> str | None:
    """Why the owner's reservation cannot take the request's KV (a pool of ``num_slots``)."""
    n_new = msg.num_tokens - res.num_cached_tokens
    if not 0 <= res.num_cached_tokens <= msg.num_tokens or len(res.slots) != n_new:
        return (
            f"slot owner reserved {len(res.slots)} slots with {res.num_cached_tokens} cached "
            f"for {msg.num_tokens} tokens (need {n_new} slots)"
        )
    if res.slots and not 0 <= min(res.slots) <= max(res.slots) < num_slots:
        return f"slot owner gave slots outside [0, {num_slots})"
    return None


def _ready_msg(transfer_id: str, res: SlotReservation) -> TransferReadyMsg:
    return TransferReadyMsg(
        transfer_id=transfer_id, slots=res.slots, num_cached_tokens=res.num_cached_tokens
    )


def _abort_msg(transfer_id: str, reason: str, pair_broken: bool = False) -> TransferAbortMsg:
    return TransferAbortMsg(transfer_id=transfer_id, reason=reason, pair_broken=pair_broken)


def _bad_plan(msg: TransferStartMsg, num_tokens: int | None) -> str | None:
    """Why the start's wire plan cannot be followed (``num_tokens``: reserved, if known)."""
    segs = msg.segments
    if len(segs) > MAX_SEGMENTS or any(s < 1 for s in segs):
        return f"bad wire plan: {len(segs)} segments {segs[: MAX_SEGMENTS + 1]}"
    if segs and num_tokens is not None and sum(segs) != num_tokens:
        return f"wire plan of {sum(segs)} tokens, {num_tokens} slots reserved"
    return None
