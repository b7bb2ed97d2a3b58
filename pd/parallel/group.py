"""The node's ranks joined in one torch.distributed group (gloo on the CPU, NCCL on CUDA), and
the sums and copies over it, every wait bounded by ``EngineConfig.tensor_parallel_timeout_s``.
The group rendezvouses over a ``FileStore`` in a directory only this user can read: no store
port is open.

A deterministic node sums by gathering every rank's part and adding them in rank order, so a
row's bits depend on neither the batch nor the collective's algorithm; otherwise by all-reduce.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist


class TensorParallelError(RuntimeError):
    """A rank of the node died, froze past the timeout or erred: the node cannot go on."""


# -- the sum over ranks: an opaque operator, so a compiled step calls it as it is -----------

_GROUPS: dict[int, TPGroup] = {}
_JOIN_TIMEOUT_S = 120.0


@torch.library.custom_op("pd_tp::all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` summed over the ranks of group ``group`` (every rank gets the sum)."""
    return _GROUPS[group].all_reduce(x)


@tp_all_reduce.register_fake
def _(x: torch.Tensor, group: int) -> torch.Tensor:
    return torch.empty_like(x)


class TPGroup:
    """The node's ranks, joined. Building one blocks until every rank has joined (or the
    timeout passes)."""

    def __init__(
        self,
        rank: int,
        size: int,
        store_dir: str,
        device: torch.device,
        timeout_s: float,
        deterministic: bool,
    ) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.timeout_s = timeout_s
        self.deterministic = deterministic
        # joining waits for the slowest rank to start (imports, seconds on a busy machine);
        # each sum afterwards waits ``timeout_s`` at most (``_wait``)
        timeout = timedelta(seconds=max(timeout_s, _JOIN_TIMEOUT_S))
        self._store = dist.FileStore(os.path.join(store_dir, "store"), size)
        self._store.set_timeout(timeout)
        try:
            if device.type == "cuda":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                self._pg: dist.ProcessGroup = dist.ProcessGroupNCCL(self._store, rank, size, opts)
            else:
                gloo = dist.ProcessGroupGloo._Options()
                gloo._timeout = timeout
                gloo._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
                self._pg = dist.ProcessGroupGloo(self._store, rank, size, gloo)
        except RuntimeError as e:
            raise TensorParallelError(
                f"rank {rank} of {size} could not join its node's group within "
                f"{timeout.total_seconds():.0f} s: {e}"
            ) from e
        self.id = id(self)
        _GROUPS[self.id] = self
        self._broken: str | None = None

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """What the model's row-parallel layers call: the sum as an opaque operator."""
        return torch.ops.pd_tp.all_reduce(x, self.id)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self._broken is not None:
            raise TensorParallelError(self._broken)
        try:
            if not self.deterministic:
                out = x.contiguous().clone()
                self._wait(self._pg.allreduce([out]))
                return out
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self._wait(self._pg.allgather([parts], [x.contiguous()]))
            acc = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
            out = parts[0].to(acc)
            for part in parts[1:]:  # in rank order: the same bits whatever the batch
                out.add_(part.to(acc))
            return out.to(x.dtype)
        except TensorParallelError:
            raise
        except RuntimeError as e:  # a peer gone (connection closed) or past the timeout
            self._broken = f"rank {self.rank} of {self.size}: a sum over the node failed: {e}"
            raise TensorParallelError(self._broken) from e

    def _wait(self, work: dist.Work) -> None:
        if work.wait(timedelta(seconds=self.timeout_s)) is False:
            raise TensorParallelError(
                f"rank {self.rank} of {self.size}: a sum over the node took over "
                f"{self.timeout_s} s (a rank frozen?)"
            )

    def gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape), on rank 0 (elsewhere: [])."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else []
        self._collective(lambda: self._pg.gather([parts] if parts else [], [x], opts))
        return parts

    def scatter(self, out: torch.Tensor, parts: Sequence[torch.Tensor] = ()) -> None:
        """Rank r's ``out`` <- rank 0's ``parts[r]``."""
        opts = dist.ScatterOptions()
        opts.rootRank = 0
        self._collective(lambda: self._pg.scatter([out], [list(parts)] if parts else [], opts))

    def _collective(self, start: Callable[[], dist.Work]) -> None:
        if self._broken is not None:
            raise TensorParallelError(self._broken)
        try:
            self._wait(start())
        except TensorParallelError:
            raise
        except RuntimeError as e:
            self._broken = f"rank {self.rank} of {self.size}: a copy over the node failed: {e}"
            raise TensorParallelError(self._broken) from e

    def close(self) -> None:
        _GROUPS.pop(self.id, None)
        try:
            self._pg.abort()  # a blocked peer errs at once
        except (RuntimeError, AttributeError):
            pass
