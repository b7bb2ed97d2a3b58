"""The sending side (prefill node): one ``KVSender`` per transfer, driven by ``progress()``.

BOOTSTRAPPING (request sent; "no room" -> ask again until handshake_timeout_s)
  -> WAITING (receiver reserved slots; waiting for ``send()``)
  -> TRANSFERRING (start message + data on the pair; then waiting for the receiver's ack)
  -> SUCCESS (ack) | FAILED (timeout, abort either way, pair error)
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from transfer.control import ControlPlane
from transfer.datapath import DataJob, JobResult, KVLayout, PairWorker
from transfer.layout import WirePlan, in_wire_order, plan_wire
from transfer.messages import (
    NoRoomMsg,
    TransferAbortMsg,
    TransferDoneMsg,
    TransferReadyMsg,
    TransferRequestMsg,
    TransferStartMsg,
)
from transfer.state import KVPoll, TransferConfig, TransferHandle

log = logging.getLogger(__name__)


@dataclass(eq=False)
class SendRecord:
    transfer_id: str
    peer: str
    num_tokens: int
    token_ids: list[int] | None
    deadline: float
    state: KVPoll = KVPoll.BOOTSTRAPPING
    worker: PairWorker | None = None  # the pair named in the last request
    prefix: str = ""
    next_request_at: float = 0.0
    num_no_room: int = 0
    num_cached_tokens: int = 0
    dst_slots: list[int] = field(default_factory=list)
    src_slots: torch.Tensor | None = None  # [num_tokens] int64, set by send()
    num_ready_layers: int = 0
    job: DataJob | None = None
    failure: str | None = None
    finished_at: float = math.inf


class KVSender(TransferHandle["SenderSide", SendRecord]):
    """Handle of one outgoing transfer. Every method returns at once."""

    @property
    def num_cached_tokens(self) -> int:
        """Leading tokens the receiver already held (valid from WAITING on); not sent."""
        return self._rec.num_cached_tokens

    def send(
        self, slots: Sequence[int] | torch.Tensor, num_ready_layers: int | None = None
    ) -> None:
        """Send the KV of ``slots`` (one per token, ``num_tokens`` of them). Layers below
        ``num_ready_layers`` (default: all) may be read now; raise it with
        ``set_ready_layers`` as the forward pass finishes layers. May be called before the
        handshake is done: the data starts once the receiver is ready."""
        self._side.send(self._rec, slots, num_ready_layers)
        self._progress()

    def set_ready_layers(self, num_ready_layers: int) -> None:
        self._side.set_ready_layers(self._rec, num_ready_layers)

    def abort(self, reason: str = "aborted by sender") -> None:
        self._side.fail(self._rec, reason)


class SenderSide:
    def __init__(
        self,
        cfg: TransferConfig,
        ctrl: ControlPlane,
        layout: KVLayout,
        kind: str,
        new_worker: Callable[[str], tuple[PairWorker, str]],
    ) -> None:
        self._cfg, self._ctrl, self._layout, self._kind = cfg, ctrl, layout, kind
        self._new_worker = new_worker  # peer -> (worker as rank 0, its group prefix)
        self._workers: dict[str, tuple[PairWorker, str]] = {}  # peer -> current pair
        self._closed: dict[str, float] = {}  # peer -> until when new transfers to it fail
        self.records: dict[str, SendRecord] = {}
        self.num_retries = 0  # requests sent again after a "no room" answer, since the start

    # -- owner calls

    def create(
        self, transfer_id: str, peer: str, num_tokens: int, token_ids: Sequence[int] | None
    ) -> SendRecord:
        if transfer_id in self.records:
            raise ValueError(f"transfer {transfer_id!r} is already being sent")
        if num_tokens < 1 or (token_ids is not None and len(token_ids) != num_tokens):
            n_ids = None if token_ids is None else len(token_ids)
            raise ValueError(f"num_tokens {num_tokens} must be >= 1 and match {n_ids} token ids")
        deadline = time.monotonic() + self._cfg.handshake_timeout_s
        rec = SendRecord(
            transfer_id, peer, num_tokens, None if token_ids is None else list(token_ids), deadline
        )
        rec.num_ready_layers = self._layout.num_layers
        self.records[transfer_id] = rec
        if self._closed.get(peer, 0.0) > time.monotonic():
            self.fail(rec, f"peer {peer} is closed", notify=False)
            return rec
        self._request(rec)
        return rec

    def send(
        self, rec: SendRecord, slots: Sequence[int] | torch.Tensor, num_ready_layers: int | None
    ) -> None:
        if rec.src_slots is not None:
            raise ValueError(f"send() called twice for transfer {rec.transfer_id!r}")
        src = torch.as_tensor(slots, dtype=torch.int64).to(self._layout.device).flatten()
        if src.numel() != rec.num_tokens:
            raise ValueError(
                f"transfer {rec.transfer_id!r}: {src.numel()} slots for {rec.num_tokens} tokens"
            )
        if src.numel() and not 0 <= int(src.min()) <= int(src.max()) < self._layout.num_slots:
            raise ValueError(f"source slots outside [0, {self._layout.num_slots})")
        rec.src_slots = src
        rec.num_ready_layers = (
            self._layout.num_layers if num_ready_layers is None else num_ready_layers
        )
        if rec.state == KVPoll.WAITING:
            self._start(rec)

    def set_ready_layers(self, rec: SendRecord, num_ready_layers: int) -> None:
        was_ready = rec.num_ready_layers == self._layout.num_layers
        rec.num_ready_layers = max(rec.num_ready_layers, num_ready_layers)
        if rec.job is not None:
            rec.job.set_ready_layers(num_ready_layers)
        elif not was_ready and rec.num_ready_layers == self._layout.num_layers:
            # a handshake started while the data was being computed gets its full timeout from
            # the moment the data is ready: the sender's own compute is not the receiver's delay
            rec.deadline = max(rec.deadline, time.monotonic() + self._cfg.handshake_timeout_s)

    def fail(
        self, rec: SendRecord, reason: str, notify: bool = True, pair_broken: bool = False
    ) -> None:
        if rec.state.is_final:
            return
        log.info("send %s failed: %s", rec.transfer_id, reason)
        if notify:  # even while bootstrapping: the receiver may have reserved slots already
            self._ctrl.send(
                rec.peer,
                TransferAbortMsg(
                    transfer_id=rec.transfer_id, reason=reason, pair_broken=pair_broken
                ),
            )
        rec.state, rec.failure, rec.finished_at = KVPoll.FAILED, reason, time.monotonic()
        if rec.job is not None:
            rec.job.cancel()  # the worker still sends what it started, so the stream stays whole

    def reopen_peer(self, peer: str) -> None:
        """A new agent at ``peer``'s endpoint: new transfers to it go ahead."""
        self._closed.pop(peer, None)

    def close_peer(self, peer: str) -> None:
        """``peer`` is gone: fail what is in flight to it, drop its pair and socket, and fail
        new transfers to it for ``linger_s`` (a late request must not reopen them)."""
        self._closed[peer] = time.monotonic() + self._cfg.linger_s
        for rec in self.records.values():
            if rec.peer == peer:
                self.fail(rec, f"peer {peer} closed")
        if (w := self._workers.pop(peer, None)) is not None:
            w[0].close()
        self._ctrl.forget(peer)

    # -- progress

    def on_msg(self, peer: str, msg: object) -> None:
        rec = self.records.get(getattr(msg, "transfer_id", ""))
        if rec is None or rec.peer != peer:
            return
        if isinstance(msg, TransferAbortMsg) and msg.pair_broken:
            self._retire(rec.worker)  # before our own worker notices: no new transfer uses it
        if rec.state.is_final:
            return
        if isinstance(msg, TransferReadyMsg) and rec.state == KVPoll.BOOTSTRAPPING:
            n_new = rec.num_tokens - msg.num_cached_tokens
            if not 0 <= msg.num_cached_tokens <= rec.num_tokens or len(msg.slots) != n_new:
                self.fail(
                    rec,
                    f"bad ready: {len(msg.slots)} slots, {msg.num_cached_tokens} cached, {rec.num_tokens} tokens",
                )
                return
            rec.state, rec.num_cached_tokens, rec.dst_slots = (
                KVPoll.WAITING,
                msg.num_cached_tokens,
                msg.slots,
            )
            if rec.src_slots is not None:
                self._start(rec)
        elif isinstance(msg, NoRoomMsg) and rec.state == KVPoll.BOOTSTRAPPING:
            rec.next_request_at = time.monotonic() + self._cfg.retry_interval_s
            rec.num_no_room += 1
        elif isinstance(msg, TransferDoneMsg) and rec.state == KVPoll.TRANSFERRING:
            rec.state, rec.finished_at = KVPoll.SUCCESS, time.monotonic()
        elif isinstance(msg, TransferAbortMsg):
            self.fail(rec, f"aborted by receiver: {msg.reason}", notify=False)

    def on_result(self, res: JobResult) -> None:
        rec = self.records.get(res.job.transfer_id)
        if rec is not None and rec.job is res.job and res.error is not None:
            self.fail(rec, res.error)
        self._drop_broken()

    def tick(self, now: float) -> None:
        for peer in [p for p, until in self._closed.items() if until < now]:
            del self._closed[peer]
        for rec in list(self.records.values()):
            if rec.state.is_final:
                if now - rec.finished_at > self._cfg.linger_s:
                    del self.records[rec.transfer_id]
            elif rec.state == KVPoll.BOOTSTRAPPING and now > rec.deadline:
                why = f"no room ({rec.num_no_room} tries)" if rec.num_no_room else "no answer"
                self.fail(rec, f"{why} within handshake timeout {self._cfg.handshake_timeout_s} s")
                if not rec.num_no_room:
                    self._retire(rec.worker)  # the peer is silent: build afresh next time
            elif rec.state == KVPoll.BOOTSTRAPPING and 0 < rec.next_request_at <= now:
                self.num_retries += 1
                self._request(rec)
            elif rec.state == KVPoll.TRANSFERRING and now > rec.deadline:
                # The pair is stuck (peer gone, or still in its rendezvous): drop it now rather
                # than when its worker notices, so the next transfer builds a new one.
                self.fail(rec, f"not acknowledged within {self._cfg.timeout_s} s", pair_broken=True)
                self._retire(rec.worker)
        self._drop_broken()

    @property
    def num_pairs(self) -> int:
        return len(self._workers)

    @property
    def num_open(self) -> int:
        """Transfers not yet final."""
        return sum(not r.state.is_final for r in self.records.values())

    def close(self) -> None:
        for worker, _ in self._workers.values():
            worker.close(join_timeout_s=1.0)
        self._workers.clear()

    # -- helpers

    def _request(self, rec: SendRecord) -> None:
        w = self._workers.get(rec.peer)
        if w is None or w[0].is_broken:
            w = self._workers[rec.peer] = self._new_worker(rec.peer)
        (rec.worker, rec.prefix), rec.next_request_at = w, 0.0
        lo = self._layout
        msg = TransferRequestMsg(
            transfer_id=rec.transfer_id,
            num_tokens=rec.num_tokens,
            group_prefix=w[1],
            backend=self._kind,
            num_layers=lo.num_layers,
            elems_per_token=lo.elems_per_token,
            dtype=lo.dtype_name,
            token_ids=rec.token_ids,
        )
        self._ctrl.send(rec.peer, msg)

    def _start(self, rec: SendRecord) -> None:
        assert rec.worker is not None and rec.src_slots is not None
        current = self._workers.get(rec.peer)
        if rec.worker.is_broken or current is None or current[0] is not rec.worker:
            self.fail(rec, "pair broke before the data started")
            return
        seq, rec.worker.next_seq = rec.worker.next_seq, rec.worker.next_seq + 1
        rec.deadline = time.monotonic() + self._cfg.timeout_s
        slots = rec.src_slots[rec.num_cached_tokens :]
        plan = WirePlan(False, [])
        if slots.numel():
            dst = torch.tensor(rec.dst_slots, dtype=torch.int64, device=slots.device)
            plan = plan_wire(slots, dst)
            slots = in_wire_order(slots, dst, plan.by_dst)
        rec.job = DataJob(
            transfer_id=rec.transfer_id,
            is_send=True,
            slots=slots,
            deadline=rec.deadline,
            seq=seq,
            num_ready_layers=rec.num_ready_layers,
            plan=plan,
        )
        rec.state = KVPoll.TRANSFERRING
        start = TransferStartMsg(
            transfer_id=rec.transfer_id,
            seq=seq,
            group_prefix=rec.prefix,
            by_dst=plan.by_dst,
            segments=plan.segments,
        )
        self._ctrl.send(rec.peer, start)
        rec.worker.submit(rec.job)

    def _drop_broken(self) -> None:
        for worker, _ in list(self._workers.values()):
            if worker.is_broken:
                self._retire(worker)

    def _retire(self, worker: PairWorker | None) -> None:
        for peer, (w, _) in list(self._workers.items()):
            if w is worker:
                del self._workers[peer]
                w.close()
