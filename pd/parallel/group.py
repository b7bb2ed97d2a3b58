"""A node of N ranks: rank 0 (the node as ever) plans each step, ranks 1..N-1 follow.

    rank 0 (the node's process)              rank r >= 1 (a process rank 0 started)
    ------------------------------------     ---------------------------------------
    RankProcesses.start: spawn ranks    ->   pd.parallel.group.main
    load its shard                           load its shard
    TPGroup: join the group (FileStore) <->  TPGroup: join the group
    each step: PlanWriter.forward(seqs) ->   PlanReader.next() -> the same forward
    forward, two all-reduces a layer    <->  forward, the same all-reduces
    sample (rank 0 alone)
    close: PlanWriter.stop()            ->   exit

The plan goes down a pipe per rank as a few int32 arrays (no pickling); the sums go through
one torch.distributed group (gloo on the CPU, NCCL on CUDA), every wait bounded by
``EngineConfig.tensor_parallel_timeout_s``. The group rendezvouses over a ``FileStore`` in a
directory only this user can read: no store port is open.

Fate is shared: a rank that exits or errs makes rank 0's next sum fail
(``TensorParallelError``), and the node stops (a cluster replaces it); rank 0's death closes
the pipes (and the kernel kills its ranks: ``PR_SET_PDEATHSIG``), so no rank outlives it.

A deterministic node sums by gathering every rank's part and adding them in rank order, so a
row's bits depend on neither the batch nor the collective's algorithm; otherwise by all-reduce.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from enum import IntEnum
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from pd.core.batch import SeqInput

if TYPE_CHECKING:
    from pd.executor.config import EngineConfig

logger = logging.getLogger(__name__)


class TensorParallelError(RuntimeError):
    """A rank of the node died, froze past the timeout or erred: the node cannot go on."""


# -- the sum over ranks: an opaque operator, so a compiled step calls it as it is -----------

_GROUPS: dict[int, TPGroup] = {}
_JOIN_TIMEOUT_S = 120.0
RANK_BEAT_S = 0.25  # a rank writes a byte to rank 0 this often ...
RANK_SILENCE_S = 3.0  # ... and is taken for frozen after this long without one


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


# -- the plan: what rank 0 tells its ranks each step -----------------------------------------

_FORWARD, _STOP, _KV = 1, 2, 3
_HEADER = struct.Struct("<BBI")  # op, return_all_logits or KV op, number of sequences or slots
_LEN = struct.Struct("<I")


class KVOp(IntEnum):
    """A copy of KV that every rank makes on its own shard (``pd.executor.host_pool``'s tier):
    ``src``/``dst`` slot lists; the byte ops move a disk chunk's payload through rank 0."""

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


# -- the ranks' processes ------------------------------------------------------------------


def threads_per_rank(cfg: EngineConfig) -> int | None:
    """On the CPU a node's cores split over its ranks: this rank's torch threads."""
    from pd.core import envs

    if cfg.torch_device.type != "cpu":
        return cfg.num_threads or envs.PD_NUM_THREADS
    total = cfg.num_threads or envs.PD_NUM_THREADS or torch.get_num_threads()
    return max(1, total // cfg.tensor_parallel_size)


class RankProcesses:
    """Ranks 1..N-1 of a node, as processes of rank 0 (one device each on CUDA)."""

    def __init__(self, cfg: EngineConfig, machine_nodes: int = 1) -> None:
        self.cfg = cfg
        self.machine_nodes = machine_nodes
        self.size = cfg.tensor_parallel_size
        self.store_dir = tempfile.mkdtemp(prefix="pd-tp-")  # 0700: this user's alone
        self._procs: list[subprocess.Popen[bytes]] = []
        self.plans: PlanWriter | None = None
        self._beats: list[int] = []  # per rank: the read end of its heartbeat pipe
        self._last_beat: list[float] = []

    def start(self) -> None:
        """Spawn every rank (they load their shards while rank 0 loads its own)."""
        fds = []
        for rank in range(1, self.size):
            read_fd, write_fd = os.pipe()
            beat_r, beat_w = os.pipe()
            os.set_blocking(beat_r, False)
            spec = {
                "rank": rank,
                "store_dir": self.store_dir,
                "plan_fd": read_fd,
                "beat_fd": beat_w,
                "machine_nodes": self.machine_nodes,
                "config": dataclasses.asdict(self.cfg),
            }
            self._procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _RANK_MAIN, json.dumps(spec)],
                    pass_fds=(read_fd, beat_w),
                    preexec_fn=_die_with_parent,
                )
            )
            os.close(read_fd)
            os.close(beat_w)
            fds.append(write_fd)
            self._beats.append(beat_r)
            self._last_beat.append(time.monotonic())
        self.plans = PlanWriter(fds, self.cfg.tensor_parallel_timeout_s)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def check(self) -> None:
        """Raise if a rank has exited, or has not beaten for ``RANK_SILENCE_S`` (frozen: an
        idle node would otherwise find out only at its next sum)."""
        now = time.monotonic()
        for i, proc in enumerate(self._procs):
            if proc.poll() is not None:
                raise TensorParallelError(f"rank {i + 1} exited with code {proc.returncode}")
            try:
                if os.read(self._beats[i], 4096):
                    self._last_beat[i] = now
            except BlockingIOError:
                pass
            if now - self._last_beat[i] > RANK_SILENCE_S:
                raise TensorParallelError(
                    f"rank {i + 1} silent for {now - self._last_beat[i]:.1f} s (frozen?)"
                )

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.plans is not None:
            self.plans.stop()
            self.plans.close()
            self.plans = None
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs = []
        for fd in self._beats:
            os.close(fd)
        self._beats = []
        for name in os.listdir(self.store_dir):
            os.unlink(os.path.join(self.store_dir, name))
        os.rmdir(self.store_dir)


# a rank's process runs ``main`` of this module as imported (``-m`` would run a second copy of
# it as __main__, with classes of its own)
_RANK_MAIN = "import sys; from pd.parallel.group import main; sys.exit(main(sys.argv[1:]))"


def _die_with_parent() -> None:
    # the kernel sends SIGKILL to this rank when rank 0's thread that started it ends: a rank
    # never outlives its node (Linux; elsewhere the closed pipe ends it)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _beat(fd: int) -> None:
    """A rank's heartbeat to rank 0 (a frozen process beats no more)."""
    try:
        while True:
            os.write(fd, b"\0")
            time.sleep(RANK_BEAT_S)
    except OSError:  # rank 0 is gone
        return


def main(argv: Sequence[str]) -> int:
    """A rank >= 1: build the shard, then run what rank 0 plans until it stops."""
    from pd.executor.config import EngineConfig
    from pd.executor.runner import ModelRunner

    spec = json.loads(argv[0])
    logging.basicConfig(level=logging.WARNING)
    fields = spec["config"]  # JSON has no tuples: a repeatable flag's values came as a list
    cfg = EngineConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    # beating from the start: rank 0 counts a rank's silence from its spawn
    threading.Thread(target=_beat, args=(spec["beat_fd"],), daemon=True).start()
    runner = ModelRunner(
        cfg, rank=spec["rank"], store_dir=spec["store_dir"], machine_nodes=spec["machine_nodes"]
    )
    runner.make_host_pool()  # its part of rank 0's host tier, if the node has one
    assert runner.rank_kv is not None
    reader = PlanReader(spec["plan_fd"])
    try:
        while not (plan := reader.next()).is_stop:
            if plan.seqs is not None:
                runner.forward(plan.seqs, return_all_logits=plan.return_all_logits)
            else:
                assert plan.kv_op is not None
                runner.rank_kv.follow(plan.kv_op, plan.src, plan.dst)
    except TensorParallelError as e:
        logger.error("%s", e)
        return 1
    finally:
        runner.close()
    return 0
