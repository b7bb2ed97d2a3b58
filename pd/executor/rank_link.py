"""The runner's seam to the other ranks of a tensor-parallel node: what ``ModelRunner`` calls,
so it imports nothing of ``pd.parallel``, which implements it (``pd.parallel.ranks.RankLink``)
and builds the runner of each rank."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from pd.cache.host_tier import BaseKVMover
from pd.core.batch import SeqInput
from pd.core.kv_pool import KVPool
from pd.executor.host_pool import HostKVPool


class BaseRankLink(ABC):
    """Rank ``rank`` of a node of ``size`` ranks, as its runner sees the others."""

    rank: int
    size: int

    @abstractmethod
    def join(self, device: torch.device, deterministic: bool) -> None:
        """Rank 0 first starts ranks 1..N-1 (they load their shards while it loads its own);
        then every rank joins the node's group, blocking until all have (or the timeout
        passes: ``TensorParallelError``)."""

    @abstractmethod
    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the node's ranks: the model's row-parallel layers call it."""

    @abstractmethod
    def attach(self, pool: KVPool, num_kv_heads: int) -> None:
        """Once this rank's pool exists: the KV copies between the ranks, and (rank 0 of a
        staged node) the staging pool of every head."""

    @abstractmethod
    def send_forward(self, seqs: Sequence[SeqInput], return_all_logits: bool) -> None:
        """Rank 0: order the other ranks to run this batch beside it (elsewhere: nothing)."""

    @property
    @abstractmethod
    def staging_pool(self) -> KVPool | None:
        """The pool of every head the transfer plane moves KV through (None: not staged)."""

    @abstractmethod
    def mirror(self, slots: Sequence[int]) -> None:
        """Copy what the ranks' layers wrote at ``slots`` into the staging pool."""

    @abstractmethod
    def host_pool(self, local: HostKVPool) -> BaseKVMover:
        """The host tier's pool of the node: ``local`` holds this rank's shard, and rank 0's
        orders the others' copies."""

    @abstractmethod
    def check(self) -> None:
        """Raise ``TensorParallelError`` if a rank of the node has exited or gone silent."""

    @abstractmethod
    def close(self) -> None:
        """Stop the node's other ranks (rank 0) and leave the group."""
