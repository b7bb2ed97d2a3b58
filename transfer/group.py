"""Two-rank process groups over torch.distributed, one per (sender, receiver) pair.

No global world: each pair incarnation rendezvouses over its own ``PairStore``, whose keys
travel as sealed messages on the control plane (``rendezvous.py``), so a broken pair is simply
dropped and the next one is built under a new prefix, and no store port is open. The group's
own ``send``/``recv`` are used, because the ``torch.distributed.send/recv`` wrappers refuse
groups not registered in a world. Gloo moves CPU tensors, NCCL CUDA tensors (and needs the two
ranks on different GPUs).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from transfer.backend import BaseTransferBackend, PairError, Pending

_PEER_TAG = 0


class _TorchPending(Pending):
    def __init__(self, work: dist.Work) -> None:
        self._work = work

    def wait(self, timeout_s: float) -> None:
        # Gloo raises on timeout (and closes the pair). NCCL blocks the CPU until done or
        # timed out and makes the current stream wait on the op, so kernels that read the
        # buffer afterwards on that stream see the data.
        ok = self._work.wait(timedelta(seconds=max(timeout_s, 0.001)))
        if ok is False:
            raise PairError(f"pair op did not complete within {timeout_s:.3f} s")


class TorchPairGroup(BaseTransferBackend):
    """One end of a gloo or NCCL pair. The constructor blocks until the peer joins (or
    ``timeout_s`` passes), so build it on a worker thread, never on a node's event loop."""

    def __init__(
        self,
        kind: str,
        *,
        store: dist.Store,
        prefix: str,
        rank: int,
        timeout_s: float,
        device: torch.device,
        local_host: str = "127.0.0.1",
    ) -> None:
        if kind not in ("gloo", "nccl"):
            raise ValueError(f"pair backend must be gloo or nccl, got {kind!r}")
        if kind == "nccl" and device.type != "cuda":
            raise ValueError(f"nccl pairs move CUDA tensors, got device {device}")
        if kind == "gloo" and device.type != "cpu":
            raise ValueError(f"gloo pairs move CPU tensors, got device {device}")
        assert rank in (0, 1), rank
        timeout = timedelta(seconds=timeout_s)
        self._store = store  # the group calls back into it: it must outlive the group
        self.kind, self.rank, self.device, self.prefix = kind, rank, device, prefix
        self._closed = False
        if kind == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
            self._pg: dist.ProcessGroup = dist.ProcessGroupGloo(store, rank, 2, opts)
        else:
            torch.cuda.set_device(device)
            nccl_opts = dist.ProcessGroupNCCL.Options()
            nccl_opts._timeout = timeout
            # The NCCL communicator is created lazily by the first send/recv, on both ends.
            self._pg = dist.ProcessGroupNCCL(store, rank, 2, nccl_opts)

    def isend(self, tensor: torch.Tensor) -> Pending:
        if self._closed:
            raise PairError(f"pair {self.prefix} is closed")
        return _TorchPending(self._pg.send([tensor], 1 - self.rank, _PEER_TAG))

    def irecv(self, tensor: torch.Tensor) -> Pending:
        if self._closed:
            raise PairError(f"pair {self.prefix} is closed")
        return _TorchPending(self._pg.recv([tensor], 1 - self.rank, _PEER_TAG))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            # NCCL: abort() frees communicators without waiting for in-flight kernels.
            # Gloo: abort() closes the pair's sockets so a blocked peer errors out at once.
            self._pg.abort()
        except RuntimeError:
            pass
        del self._pg
