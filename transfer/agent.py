"""``TransferAgent``: one per node. It owns the control socket, the pair workers and every
transfer's state, and advances them in ``progress()``, which never blocks."""

from __future__ import annotations

import queue
import time
from collections.abc import Sequence

import torch

from transfer.control import ControlPlane
from transfer.datapath import KVLayout
from transfer.endpoint import parse_endpoint
from transfer.inbound import RejectsByPeer
from transfer.messages import PairKeyMsg
from transfer.pairs import PairFactory
from transfer.receiver import KVReceiver, ReceiverSide
from transfer.rendezvous import Route
from transfer.sender import KVSender, SenderSide
from transfer.state import BaseSlotOwner, KVPoll, TransferConfig


class TransferAgent:
    """Moves KV between this node's buffers and other nodes' (see the package docstring).

    ``buffers`` is the flat list ``k[0..L-1] + v[0..L-1]`` (all ``[num_slots, ...]``, one
    dtype and device); ``num_layers`` splits it into layers. ``slot_owner`` is required to
    receive. Call ``progress()`` (or any handle's ``poll()``) from the node's loop; the slot
    owner is only ever called from inside it.
    """

    def __init__(
        self,
        cfg: TransferConfig,
        buffers: Sequence[torch.Tensor],
        num_layers: int,
        slot_owner: BaseSlotOwner | None = None,
    ) -> None:
        self.cfg = cfg
        self.layout = KVLayout(buffers, num_layers)
        kind = cfg.backend
        if kind == "auto":
            kind = "nccl" if self.layout.device.type == "cuda" else "gloo"
        if kind == "nccl" and self.layout.device.type != "cuda":
            raise ValueError(f"backend nccl needs CUDA buffers, got {self.layout.device}")
        self.kind = kind
        self._ctrl = ControlPlane(
            cfg.secret,
            cfg.host,
            cfg.port,
            max_msg_age_s=cfg.max_msg_age_s,
            max_frame_size=cfg.max_frame_bytes,
            max_conns=cfg.max_conns,
        )
        self._pairs = PairFactory(cfg, kind, self.layout, self._ctrl.endpoint)
        self._rendezvous = self._pairs.rendezvous
        self._sender = SenderSide(cfg, self._ctrl, self.layout, kind, self._pairs.for_send)
        self._receiver = ReceiverSide(
            cfg, self._ctrl, self.layout, kind, slot_owner, self._pairs.for_recv
        )
        self._closed = False

    @property
    def endpoint(self) -> str:
        """Where peers send control messages; announce it (e.g. to the coordinator)."""
        return self._ctrl.endpoint

    @property
    def num_dropped_msgs(self) -> int:
        """Authentic control frames dropped as malformed or undeliverable."""
        return self._ctrl.num_dropped

    @property
    def num_rejected_msgs(self) -> int:
        """Control frames that failed authentication (forged, altered, replayed, stale)."""
        return self._ctrl.num_rejected

    @property
    def rejects(self) -> RejectsByPeer:
        """Refused control frames by sending address."""
        return self._ctrl.rejects

    @property
    def num_retries(self) -> int:
        """Transfer requests this agent sent again after a "no room" answer (since it started)."""
        return self._sender.num_retries

    @property
    def num_held_requests(self) -> int:
        """Transfer requests this agent held because its slot owner did not know their id yet
        (``BaseSlotOwner.knows``), instead of answering "no room" (since it started)."""
        return self._receiver.num_held

    @property
    def num_rendezvous(self) -> int:
        """Pair groups whose rendezvous is under way."""
        return self._rendezvous.num_open

    @property
    def num_pairs(self) -> int:
        """Live pair groups (as sender plus as receiver)."""
        return self._sender.num_pairs + self._receiver.num_pairs

    @property
    def num_open_transfers(self) -> int:
        """Transfers in flight (as sender plus as receiver)."""
        return self._sender.num_open + self._receiver.num_open

    @property
    def num_sockets(self) -> int:
        """Open control sockets (the ROUTER and one DEALER per peer sent to)."""
        return self._ctrl.num_sockets

    def sender(
        self, transfer_id: str, peer: str, num_tokens: int, token_ids: Sequence[int] | None = None
    ) -> KVSender:
        """Start a transfer of ``num_tokens`` tokens to the agent at ``peer``: the handshake
        begins now, the data when ``send()`` has been called and the receiver is ready.
        ValueError if ``peer`` is not a ``tcp://host:port`` to dial."""
        parse_endpoint(peer)
        rec = self._sender.create(transfer_id, peer, num_tokens, token_ids)
        return KVSender(self._sender, rec, self.progress)

    def receiver(self, transfer_id: str) -> KVReceiver:
        """The incoming transfer ``transfer_id``, whether its request came yet or not."""
        return KVReceiver(self._receiver, self._receiver.get(transfer_id), self.progress)

    def answer_held(self, transfer_id: str) -> None:
        """The slot owner knows ``transfer_id`` now: a request held for it (``receiver.py``,
        HELD) is answered at once, not at the next ``progress()``. Nothing if none is held."""
        self._receiver.answer_held(transfer_id)

    def poll(self, transfer_id: str) -> KVPoll | None:
        """State of a transfer this agent sends or receives (None if unknown here)."""
        self.progress()
        rec = self._sender.records.get(transfer_id) or self._receiver.records.get(transfer_id)
        return None if rec is None else rec.state

    def progress(self) -> None:
        """Handle waiting messages, finished data jobs and deadlines. Never blocks."""
        if self._closed:
            return
        for inc in self._ctrl.recv_all():
            route: Route | None = inc.identity if inc.identity is not None else inc.peer
            assert route is not None
            if isinstance(inc.msg, PairKeyMsg):
                self._rendezvous.deliver(route, inc.msg)
            elif inc.identity is not None:
                self._receiver.on_msg(inc.identity, inc.msg)
            else:
                self._sender.on_msg(route, inc.msg)
        for out in self._rendezvous.take_outgoing():  # what the pair workers set meanwhile
            if isinstance(out.route, bytes):
                self._ctrl.reply(out.route, out.msg)
            else:
                self._ctrl.send(out.route, out.msg)
        while True:
            try:
                res = self._pairs.results.get_nowait()
            except queue.Empty:
                break
            (self._sender if res.job.is_send else self._receiver).on_result(res)
        now = time.monotonic()
        self._sender.tick(now)
        self._receiver.tick(now)

    def close_peer(self, peer: str) -> None:
        """The agent at endpoint ``peer`` is gone (dead or removed): fail what is in flight to
        or from it, drop the pair groups and the socket shared with it, and refuse it for
        ``linger_s``."""
        self._sender.close_peer(peer)
        self._receiver.close_peer(peer)

    def reopen_peer(self, peer: str) -> None:
        """A new agent listens at ``peer``, a closed one's endpoint (a replacement that the
        kernel gave the same port): take transfers to and from it again."""
        self._sender.reopen_peer(peer)
        self._receiver.reopen_peer(peer)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sender.close()
        self._receiver.close()
        self._ctrl.close()
