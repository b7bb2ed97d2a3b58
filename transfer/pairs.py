"""``PairFactory``: the pair workers of one ``TransferAgent``, each over a pair group of its
own (``group.py``, or the fake backend), named under the agent's ``sender_root`` as a sender.

A sender's pair incarnations are numbered under a per-agent id, so a rebuilt pair never reuses
a group name. The group's rendezvous store (``rendezvous.py``) is opened before the peer can
hear of the pair, so none of the peer's keys can come too early; the group itself is built on
the worker's thread, where the rendezvous blocks until the peer joins. Workers put their
results in ``results``, which the agent's ``progress`` reads.
"""

from __future__ import annotations

import itertools
import queue
import uuid

import torch

from transfer.backend import BaseTransferBackend, FakeTransferBackend
from transfer.datapath import JobResult, KVLayout, PairWorker
from transfer.group import TorchPairGroup
from transfer.messages import TransferRequestMsg
from transfer.rendezvous import Rendezvous, Route
from transfer.state import TransferConfig


def sender_root(endpoint: str) -> str:
    """Every pair group a sender whose control endpoint is ``endpoint`` builds is named under
    this prefix, so a receiver can close them all when that sender is gone."""
    return f"kvx/{endpoint}/"


class PairFactory:
    """Builds pair workers of backend ``kind`` over ``layout`` for the agent at ``endpoint``."""

    def __init__(self, cfg: TransferConfig, kind: str, layout: KVLayout, endpoint: str) -> None:
        self.cfg = cfg
        self.kind = kind
        self.layout = layout
        self.endpoint = endpoint
        # gloo moves CPU tensors (CUDA buffers are staged through the host); nccl and fake
        # move tensors where the buffers live.
        self._pair_device = torch.device("cpu") if kind == "gloo" else layout.device
        self._uid = uuid.uuid4().hex[:12]
        self._incarnations = itertools.count()
        self.rendezvous = Rendezvous(cfg.connect_timeout_s)
        self.results: queue.SimpleQueue[JobResult] = queue.SimpleQueue()

    def for_send(self, peer: str) -> tuple[PairWorker, str]:
        """A new pair incarnation with the agent at ``peer``, as rank 0, and its name."""
        prefix = f"{sender_root(self.endpoint)}{self._uid}/{next(self._incarnations)}"
        return self._new_worker(prefix, 0, peer), prefix

    def for_recv(self, identity: bytes, msg: TransferRequestMsg) -> PairWorker:
        """The pair ``msg`` names, with its sender (routing id ``identity``), as rank 1."""
        return self._new_worker(msg.group_prefix, 1, identity)

    def _new_worker(self, prefix: str, rank: int, peer: Route) -> PairWorker:
        """A worker that builds the pair as ``rank`` with ``peer``. Its store is open before
        the peer can hear of the pair, so none of the peer's keys can come too early."""
        if self.kind == "fake":
            fake = lambda: FakeTransferBackend(prefix, rank, self._pair_device)  # noqa: E731
            return PairWorker(prefix, fake, self.layout, self.results)
        store = self.rendezvous.open(prefix, peer)

        def connect() -> BaseTransferBackend:
            # On the pair's worker thread: the rendezvous blocks until the peer joins.
            try:
                return TorchPairGroup(
                    self.kind,
                    store=store,
                    prefix=prefix,
                    rank=rank,
                    timeout_s=self.cfg.connect_timeout_s,
                    device=self._pair_device,
                    local_host=self.cfg.host,
                )
            finally:
                self.rendezvous.close(prefix)

        return PairWorker(prefix, connect, self.layout, self.results)
