"""The attention interface every backend implements (``pd.executor.attention`` holds the
``torch`` one); the model calls it once per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from pd.core.batch import ForwardBatch
from pd.core.kv_pool import KVPool


class AttentionSpec(NamedTuple):
    """How one layer attends: scores times ``scale``, then ``tanh(s / softcap) * softcap``
    where ``softcap`` > 0 (Gemma 2), over the last ``window`` positions up to the query's own
    where ``window`` > 0 (a sliding-window layer), else over all of them."""

    scale: float
    softcap: float = 0.0
    window: int = 0


class BaseAttentionBackend(ABC):
    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Build the per-batch index tensors once (stored in ``batch.attn_metadata``); every
        layer's ``forward`` reuses them."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        pool: KVPool,
    ) -> torch.Tensor:
        """Write ``k``/``v`` of the batch's new tokens into ``batch.out_slots`` of layer
        ``layer``, then attend causally over each request's ``kv_slots``.

        q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]; returns [T, num_heads, head_dim].
        """
