"""The data path: move a transfer's KV layer by layer on its pair, straight from/into the
pools where the wire plan allows, else through staging buffers (gather / scatter).

Stream of one transfer on a pair (both ends run the same order, so no tags are needed):

    header  int64[8] = [MAGIC, seq, flags, num_tokens, num_layers, elems_per_token, dtype,
                        num_segments]
    layer 0: per buffer (K, then V), per segment of the plan (``layout.py``): its rows
    ...
    layer L-1

A ``PairWorker`` thread owns one pair and runs its jobs one at a time, so payloads of
concurrent transfers never interleave; the layer loops, pipelined with a copy thread per
pair, are in ``stream.py``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from transfer.backend import BaseTransferBackend, PairError
from transfer.layout import DTYPES, KVLayout, WirePlan
from transfer.stream import recv_layers, send_layers

__all__ = ["NO_SEQ", "DataJob", "JobResult", "KVLayout", "PairWorker"]

log = logging.getLogger(__name__)

MAGIC = 0x4B56_5846  # "KVXF"
FLAG_CANCELLED = 1
FLAG_BY_DST = 2  # rows travel in ascending destination-slot order (else token order)


NO_SEQ = -1  # a receiver's job before the start message names its place in the stream


@dataclass(eq=False, kw_only=True)
class DataJob:
    """One transfer's turn on a pair. Shared with the worker thread: the owner thread only
    sets ``cancelled`` and ``num_ready_layers`` (through the methods), the worker only reads.
    Built with keywords: ``DataJob(transfer_id=..., is_send=True, slots=..., ...)``."""

    transfer_id: str
    is_send: bool = False  # sender: writes the stream; receiver: reads it
    # [n] int64 in wire order (see layout.WirePlan); None on a receiver = read and drop
    slots: torch.Tensor | None
    deadline: float  # time.monotonic()
    seq: int = NO_SEQ  # the transfer's place in its pair's stream (``PairWorker.next_seq``)
    num_ready_layers: int = 0  # sender: layers the worker may read now; unused on a receiver
    plan: WirePlan = WirePlan(False, [])  # segments [] = one segment of all the tokens
    cancelled: bool = False
    started: bool = False
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)

    def set_ready_layers(self, n: int) -> None:
        with self._cond:
            self.num_ready_layers = max(self.num_ready_layers, n)
            self._cond.notify_all()

    def cancel(self) -> bool:
        """True if the worker has not started the job, so it will never touch the slots."""
        with self._cond:
            self.cancelled = True
            self._cond.notify_all()
            return not self.started

    def claim(self) -> bool:
        """Worker: start the job; False if it was cancelled first (then only the stream is
        kept in step: a cancelled header is sent, or the payload is read and dropped)."""
        with self._cond:
            self.started = True
            return not self.cancelled

    def remaining_s(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise PairError(f"transfer {self.transfer_id} passed its deadline")
        return left

    def wait_ready(self, num_layers: int) -> None:
        with self._cond:
            while self.num_ready_layers < num_layers and not self.cancelled:
                self._cond.wait(self.remaining_s())


class JobResult(NamedTuple):
    job: DataJob
    error: str | None  # None = every layer moved (and, on a receiver, scattered)


class _Cancelled(Exception):
    pass


class PairWorker:
    """A thread that connects one pair, then runs its jobs in order. After any pair error the
    pair is closed and every later job fails at once (``is_broken``); the owner drops it."""

    def __init__(
        self,
        name: str,
        connect: Callable[[], BaseTransferBackend],
        layout: KVLayout,
        results: queue.SimpleQueue[JobResult],
    ) -> None:
        self.name = name
        self.layout = layout
        self.is_broken = False
        self.next_seq = 0  # sender side: numbers this pair's transfers in stream order
        self._connect = connect
        self._results = results
        self._jobs: queue.SimpleQueue[DataJob | None] = queue.SimpleQueue()
        self._error = ""
        self._backend: BaseTransferBackend | None = None
        # Gathers and scatters of staged layers run here, beside the pair thread (stream.py).
        self._copier = ThreadPoolExecutor(1, thread_name_prefix=f"kv-copy-{name}")
        self._thread = threading.Thread(target=self._run, name=f"kv-pair-{name}", daemon=True)
        self._thread.start()

    def submit(self, job: DataJob) -> None:
        self._jobs.put(job)

    def close(self, join_timeout_s: float = 0.0) -> None:
        """Stop after the current job (each of its waits has a deadline) and drop the pair."""
        self._jobs.put(None)
        if join_timeout_s > 0:
            self._thread.join(join_timeout_s)

    def _run(self) -> None:
        try:
            self._backend = self._connect()
        except Exception as e:  # any connect failure breaks the pair
            self._break(f"connect failed: {type(e).__name__}: {e}")
        while (job := self._jobs.get()) is not None:
            if self.is_broken:
                self._results.put(JobResult(job, f"pair {self.name} broken: {self._error}"))
                continue
            assert self._backend is not None
            try:
                (self._send if job.is_send else self._recv)(self._backend, job)
                self._results.put(JobResult(job, None))
            except _Cancelled as e:
                self._results.put(JobResult(job, str(e)))
            except Exception as e:  # a failed op leaves the stream unusable
                self._break(f"{type(e).__name__}: {e}")
                self._results.put(JobResult(job, f"pair {self.name} broken: {self._error}"))
        if self._backend is not None:
            self._backend.close()
        self._copier.shutdown(wait=False)

    def _break(self, error: str) -> None:
        log.warning("pair %s broken: %s", self.name, error)
        self.is_broken, self._error = True, error
        if self._backend is not None:
            self._backend.close()

    def _header(
        self, job: DataJob, flags: int, num_tokens: int, device: torch.device
    ) -> torch.Tensor:
        lo = self.layout
        code = DTYPES.index(lo.dtype)
        flags |= FLAG_BY_DST if job.plan.by_dst else 0
        values = [MAGIC, job.seq, flags, num_tokens, lo.num_layers, lo.elems_per_token, code]
        values.append(len(job.plan.segments))
        return torch.tensor(values, dtype=torch.int64, device=device)

    def _send(self, be: BaseTransferBackend, job: DataJob) -> None:
        assert job.slots is not None
        n = job.slots.numel()
        flags = 0 if job.claim() else FLAG_CANCELLED
        be.isend(self._header(job, flags, n, be.device)).wait(job.remaining_s())
        if flags or n == 0:
            return
        segs = job.plan.segments or [n]
        send_layers(be, self.layout, job.slots, segs, self._copier, job.wait_ready, job.remaining_s)

    def _recv(self, be: BaseTransferBackend, job: DataJob) -> None:
        lo = self.layout
        dst = job.slots if job.claim() else None
        header = torch.zeros(8, dtype=torch.int64, device=be.device)
        be.irecv(header).wait(job.remaining_s())
        magic, seq, flags, n, num_layers, elems, code, num_segs = header.tolist()
        segs = job.plan.segments or [n]
        want = (MAGIC, job.seq, lo.num_layers, lo.elems_per_token, DTYPES.index(lo.dtype))
        want += (len(job.plan.segments), job.plan.by_dst)
        got = (magic, seq, num_layers, elems, code, num_segs, bool(flags & FLAG_BY_DST))
        if got != want:
            raise PairError(f"bad header {header.tolist()}, want (magic, seq, ...) {want}")
        if (dst is not None and n != dst.numel()) or n != sum(segs):
            have = None if dst is None else dst.numel()
            raise PairError(f"header says {n} tokens, {have} slots reserved, plan {segs}")
        if flags & FLAG_CANCELLED:
            raise _Cancelled("cancelled by sender")
        if n == 0:
            return
        keep = lambda: not job.cancelled  # noqa: E731 - read by the loop between layers
        recv_layers(be, lo, dst, n, segs, self._copier, keep, job.remaining_s)
        if lo.device.type == "cuda":
            torch.cuda.current_stream(lo.device).synchronize()
        if dst is None or job.cancelled:
            raise _Cancelled("cancelled by receiver")
