"""The plan: what rank 0 tells its ranks each step (a forward, a KV copy, or stop), as a few
int32 arrays down a pipe per rank (no pickling)."""

from __future__ import annotations

import os
import select
import struct
import time
from collections.abc import Sequence
from enum import IntEnum
from typing import NamedTuple

import numpy as np

from pd.core.batch import SeqInput
from pd.parallel.group import TensorParallelError

_FORWARD, _STOP, _KV = 1, 2, 3
_HEADER = struct.Struct("<BBI")  # op, return_all_logits or KV op, number of sequences or slots
_LEN = struct.Struct("<I")


class KVOp(IntEnum):
    """A copy of KV that every rank makes on its own shard (``pd.executor.host_pool``'s
    tier): ``src``/``dst`` slot lists; the byte ops move a disk chunk's payload through rank
    0."""

    SAVE = 1  # device src -> host dst
    LOAD = 2  # host src -> device dst
    GATHER_HOST = 3  # host src -> rank 0 (dst unused)
    GATHER_DEVICE = 4  # device src -> rank 0
    SCATTER_HOST = 5  # rank 0 -> host dst (src unused)
    SCATTER_DEVICE = 6  # rank 0 -> device dst


class Plan(NamedTuple):
    """One order: run ``seqs``, or copy KV (``kv_op`` of ``src`` to ``dst``); neither: stop."""

    seqs: list[SeqInput] | None
    return_all_logits: bool = False
    kv_op: KVOp | None = None
    src: list[int] = []
    dst: list[int] = []

    @property
    def is_stop(self) -> bool:
        return self.seqs is None and self.kv_op is None


def encode_forward(seqs: Sequence[SeqInput], return_all_logits: bool) -> bytes:
    """``seqs`` as int32 arrays: per sequence (new tokens, prefix length), then every new id
    and every slot, in order."""
    lens = np.array([(len(s.new_token_ids), s.num_prefix) for s in seqs], dtype=np.int32)
    ids = np.fromiter((t for s in seqs for t in s.new_token_ids), dtype=np.int32)
    slots = np.fromiter((t for s in seqs for t in s.slots), dtype=np.int32)
    head = _HEADER.pack(_FORWARD, return_all_logits, len(seqs))
    return head + lens.tobytes() + ids.tobytes() + slots.tobytes()


def encode_kv(op: KVOp, src: Sequence[int], dst: Sequence[int]) -> bytes:
    arrays = np.array(src, dtype=np.int32).tobytes() + np.array(dst, dtype=np.int32).tobytes()
    return _HEADER.pack(_KV, op, len(src)) + arrays


def decode_plan(frame: bytes) -> Plan:
    op, all_logits, n = _HEADER.unpack_from(frame)
    if op == _STOP:
        return Plan(None)
    if op == _KV:
        src = np.frombuffer(frame, dtype=np.int32, count=n, offset=_HEADER.size)
        dst = np.frombuffer(frame, dtype=np.int32, offset=_HEADER.size + 4 * n)
        return Plan(None, kv_op=KVOp(all_logits), src=src.tolist(), dst=dst.tolist())
    assert op == _FORWARD, f"unknown plan op {op}"
    at = _HEADER.size
    lens = np.frombuffer(frame, dtype=np.int32, count=2 * n, offset=at).reshape(n, 2)
    at += lens.nbytes
    num_new = int(lens[:, 0].sum())
    ids = np.frombuffer(frame, dtype=np.int32, count=num_new, offset=at).tolist()
    at += 4 * num_new
    slots = np.frombuffer(frame, dtype=np.int32, offset=at).tolist()
    seqs, i, j = [], 0, 0
    for num, prefix in lens.tolist():
        seqs.append(SeqInput(ids[i : i + num], slots[j : j + prefix + num], prefix))
        i, j = i + num, j + prefix + num
    return Plan(seqs, bool(all_logits))


class PlanWriter:
    """Rank 0's end of the pipes to its ranks."""

    def __init__(self, fds: Sequence[int], timeout_s: float) -> None:
        self._fds = list(fds)
        self.timeout_s = timeout_s

    def forward(self, seqs: Sequence[SeqInput], return_all_logits: bool) -> None:
        self._send(encode_forward(seqs, return_all_logits))

    def kv(self, op: KVOp, src: Sequence[int], dst: Sequence[int]) -> None:
        self._send(encode_kv(op, src, dst))

    def stop(self) -> None:
        try:
            self._send(_HEADER.pack(_STOP, 0, 0))
        except TensorParallelError:
            pass  # a rank gone already: closing the pipes ends the others

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def _send(self, frame: bytes) -> None:
        data = _LEN.pack(len(frame)) + frame
        deadline = time.monotonic() + self.timeout_s
        for fd in self._fds:  # a frozen rank fills its pipe: bounded by the deadline
            view = memoryview(data)
            while view:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([], [fd], [], left)[1]:
                    raise TensorParallelError(
                        f"a rank took no plan for {self.timeout_s} s (frozen?)"
                    )
                try:
                    view = view[os.write(fd, view) :]
                except BrokenPipeError as e:
                    raise TensorParallelError("a rank of the node has exited") from e


class PlanReader:
    """A rank's end of its pipe from rank 0; ``next`` blocks until a plan comes (rank 0 gone:
    a stop)."""

    def __init__(self, fd: int) -> None:
        self._file = os.fdopen(fd, "rb", buffering=1 << 16)

    def next(self) -> Plan:
        head = self._file.read(_LEN.size)
        if len(head) < _LEN.size:
            return Plan(None)
        (size,) = _LEN.unpack(head)
        frame = self._file.read(size)
        return decode_plan(frame) if len(frame) == size else Plan(None)
