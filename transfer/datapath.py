"""The data path: gather slots into contiguous per-layer buffers, move them, scatter them.

Stream of one transfer on a pair (both ends run the same order, so no tags are needed):

    header  int64[8] = [MAGIC, seq, flags, num_tokens, num_layers, elems_per_token, dtype, 0]
    layer 0: K [num_tokens * kv_heads * head_dim], then V (one message per buffer of the layer)
    ...
    layer L-1

A ``PairWorker`` thread owns one pair and runs its jobs one at a time, so payloads of
concurrent transfers never interleave. Two layers are in flight: gather (or scatter) layer
i+1 while layer i is on the wire. Scattered slots go through a staging buffer; a side whose
slots are one ascending run sends from (or receives into) its pool directly, saving a copy.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from transfer.backend import BaseTransferBackend, PairError, Pending

log = logging.getLogger(__name__)

MAGIC = 0x4B56_5846  # "KVXF"
FLAG_CANCELLED = 1
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8)
# Byte-copy stand-ins by width: gather/scatter move raw bytes, never arithmetic on values.
_WIDE_DTYPES = {
    16: torch.complex128,
    8: torch.int64,
    4: torch.int32,
    2: torch.int16,
    1: torch.uint8,
}


class KVLayout:
    """A flat buffer list ``k[0..L-1] + v[0..L-1]`` (any number of buffers per layer) seen
    layer by layer: layer i is buffers ``i, i + L, i + 2L, ...``. Every buffer is indexed by
    slot on dim 0: ``[num_slots, ...]``."""

    def __init__(self, buffers: Sequence[torch.Tensor], num_layers: int) -> None:
        if num_layers < 1 or not buffers or len(buffers) % num_layers:
            raise ValueError(f"{len(buffers)} buffers do not split into {num_layers} layers")
        first = buffers[0]
        for b in buffers:
            if b.dtype != first.dtype or b.device != first.device or b.shape[0] != first.shape[0]:
                raise ValueError(
                    f"buffers differ: {b.dtype}/{b.device}/{b.shape[0]} slots vs "
                    f"{first.dtype}/{first.device}/{first.shape[0]} slots"
                )
            if not b.is_contiguous():
                raise ValueError("KV buffers must be contiguous")
        if first.dtype not in DTYPES:
            raise ValueError(f"unsupported KV dtype {first.dtype}")
        self.layers = [list(buffers[i::num_layers]) for i in range(num_layers)]
        sizes = {sum(b[0].numel() for b in layer) for layer in self.layers}
        if len(sizes) != 1:
            raise ValueError(f"layers hold different numbers of elements per token: {sizes}")
        row_bytes = {b[0].numel() * b.dtype.itemsize for b in buffers}
        width = next(w for w in (16, 8, 4, 2, 1) if all(r % w == 0 for r in row_bytes))
        self._wide_dtype = _WIDE_DTYPES[width]
        self.num_layers = num_layers
        self.num_slots = first.shape[0]
        self.elems_per_token = sizes.pop()
        self.dtype = first.dtype
        self.device = first.device

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def num_bytes_per_token(self) -> int:
        return self.num_layers * self.elems_per_token * self.dtype.itemsize

    def gather(self, layer: int, slots: torch.Tensor, out: torch.Tensor) -> None:
        # slots: [n] int64 on self.device; out: [n * elems_per_token] contiguous
        n = slots.numel()
        dst = out if out.device == self.device else torch.empty_like(out, device=self.device)
        for b, part in zip(self.layers[layer], self.split(layer, dst, n), strict=True):
            torch.index_select(self._rows(b), 0, slots, out=self._rows(part.view(n, -1)))
        if dst is not out:
            out.copy_(dst)

    def views(self, layer: int, first_slot: int, n: int) -> list[torch.Tensor]:
        """The layer's buffers at slots ``[first_slot, first_slot + n)``, flat, no copy."""
        return [b[first_slot : first_slot + n].view(-1) for b in self.layers[layer]]

    def split(self, layer: int, flat: torch.Tensor, n: int) -> list[torch.Tensor]:
        """A gathered layer ``[n * elems_per_token]`` cut into one flat part per buffer."""
        sizes = [n * b[0].numel() for b in self.layers[layer]]
        return list(flat.split(sizes))

    def scatter(self, layer: int, slots: torch.Tensor, src: torch.Tensor) -> None:
        n = slots.numel()
        src = src.to(self.device, non_blocking=False)
        for b, part in zip(self.layers[layer], self.split(layer, src, n), strict=True):
            self._rows(b).index_copy_(0, slots, self._rows(part.view(n, -1)))

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as ``[rows, row_bytes / w]`` of a w-byte dtype: the same bytes in fewer
        elements. CPU index_copy_ costs per element, so 16-byte elements scatter ~5x faster."""
        rows = t.view(t.shape[0], -1)
        try:
            return rows.view(self._wide_dtype)
        except RuntimeError:  # a view whose storage offset is not aligned to w
            return rows


@dataclass(eq=False)
class DataJob:
    """One transfer's turn on a pair. Shared with the worker thread: the owner thread only
    sets ``cancelled`` and ``num_ready_layers`` (through the methods), the worker only reads."""

    transfer_id: str
    seq: int
    is_send: bool
    slots: torch.Tensor | None  # [n] int64; None on a receiver = read and drop (drain)
    deadline: float  # time.monotonic()
    num_ready_layers: int
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


def first_of_run(slots: torch.Tensor) -> int | None:
    """``a`` if ``slots`` is exactly ``[a, a + 1, ..., a + n - 1]`` (n >= 1), else None."""
    n = slots.numel()
    if n == 0:
        return None
    a = int(slots[0])
    if int(slots[-1]) != a + n - 1 or (n > 1 and not bool((slots.diff() == 1).all())):
        return None
    return a


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
        except Exception as e:  # noqa: BLE001 - any connect failure breaks the pair
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
            except Exception as e:  # noqa: BLE001 - a failed op leaves the stream unusable
                self._break(f"{type(e).__name__}: {e}")
                self._results.put(JobResult(job, f"pair {self.name} broken: {self._error}"))
        if self._backend is not None:
            self._backend.close()

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
        values = [MAGIC, job.seq, flags, num_tokens, lo.num_layers, lo.elems_per_token, code, 0]
        return torch.tensor(values, dtype=torch.int64, device=device)

    def _send(self, be: BaseTransferBackend, job: DataJob) -> None:
        assert job.slots is not None
        lo, n = self.layout, job.slots.numel()
        flags = 0 if job.claim() else FLAG_CANCELLED
        be.isend(self._header(job, flags, n, be.device)).wait(job.remaining_s())
        if flags or n == 0:
            return
        first = first_of_run(job.slots) if lo.device == be.device else None
        size = n * lo.elems_per_token if first is None else 0
        bufs = [torch.empty(size, dtype=lo.dtype, device=be.device) for _ in "ab"]
        inflight: list[list[Pending]] = [[], []]
        for layer in range(lo.num_layers):
            # After a cancel the rest is sent as is: the receiver drops it, the stream stays whole.
            job.wait_ready(layer + 1)
            i = layer % 2
            for p in inflight[i]:
                p.wait(job.remaining_s())
            if first is not None:
                parts = lo.views(layer, first, n)
            else:
                lo.gather(layer, job.slots, bufs[i])
                parts = lo.split(layer, bufs[i], n)
            inflight[i] = [be.isend(part) for part in parts]
        for p in inflight[0] + inflight[1]:
            p.wait(job.remaining_s())

    def _recv(self, be: BaseTransferBackend, job: DataJob) -> None:
        lo = self.layout
        dst = job.slots if job.claim() else None
        header = torch.zeros(8, dtype=torch.int64, device=be.device)
        be.irecv(header).wait(job.remaining_s())
        magic, seq, flags, n, num_layers, elems, code, _ = header.tolist()
        want = (MAGIC, job.seq, lo.num_layers, lo.elems_per_token, DTYPES.index(lo.dtype))
        if (magic, seq, num_layers, elems, code) != want:
            raise PairError(f"bad header {header.tolist()}, want (magic, seq, ...) {want}")
        if dst is not None and n != dst.numel():
            raise PairError(f"header says {n} tokens, {dst.numel()} slots reserved")
        if flags & FLAG_CANCELLED:
            raise _Cancelled("cancelled by sender")
        if n == 0:
            return
        first = first_of_run(dst) if dst is not None and lo.device == be.device else None
        size = n * elems if first is None else 0
        bufs = [torch.empty(size, dtype=lo.dtype, device=be.device) for _ in "ab"]

        def post(layer: int) -> list[Pending]:
            if layer >= num_layers:
                return []
            if first is not None:  # straight into the pool: the slots stay reserved till we end
                parts = lo.views(layer, first, n)
            else:
                parts = lo.split(layer, bufs[layer % 2], n)
            return [be.irecv(part) for part in parts]

        inflight = [post(0), post(1)]
        for layer in range(num_layers):
            i = layer % 2
            for p in inflight[i]:
                p.wait(job.remaining_s())
            if first is None and dst is not None and not job.cancelled:
                lo.scatter(layer, dst, bufs[i])
            inflight[i] = post(layer + 2)
        if lo.device.type == "cuda":
            torch.cuda.current_stream(lo.device).synchronize()
        if dst is None or job.cancelled:
            raise _Cancelled("cancelled by receiver")
