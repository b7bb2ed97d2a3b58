"""The ranks' processes (rank 0 spawns ranks 1..N-1 and watches their heartbeats), and
``RankLink``: a rank's link to the others, what its ``ModelRunner`` calls
(``pd.executor.rank_link``)."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import torch

from pd.cache.host_tier import BaseKVMover
from pd.core.batch import SeqInput
from pd.core.kv_pool import KVPool
from pd.executor.config import EngineConfig
from pd.executor.host_pool import HostKVPool
from pd.executor.rank_link import BaseRankLink
from pd.parallel.group import TensorParallelError, TPGroup
from pd.parallel.plan import PlanWriter
from pd.parallel.rank_kv import RankKV, ShardedHostKVPool, StagingPool

RANK_BEAT_S = 0.25  # a rank writes a byte to rank 0 this often ...
RANK_SILENCE_S = 3.0  # ... and is taken for frozen after this long without one


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


# a rank's process runs ``pd.parallel.main.main`` as imported (``-m`` would run a second copy
# of it as __main__, with classes of its own)
_RANK_MAIN = "import sys; from pd.parallel.main import main; sys.exit(main(sys.argv[1:]))"


def _die_with_parent() -> None:
    # the kernel sends SIGKILL to this rank when rank 0's thread that started it ends: a rank
    # never outlives its node (Linux; elsewhere the closed pipe ends it)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass




class RankLink(BaseRankLink):
    """Rank ``rank`` of a node of ``cfg.tensor_parallel_size`` ranks: on rank 0, the other
    ranks' processes (started by ``join``) and the plans it sends them; on every rank, the
    group, and once the pool exists the KV copies (``rank_kv``) and (rank 0 of a ``staged``
    node, one of a cluster) the staging pool of every head. A rank >= 1 joins the group in
    ``store_dir``, where rank 0's rendezvouses."""

    def __init__(
        self,
        cfg: EngineConfig,
        rank: int = 0,
        store_dir: str | None = None,
        machine_nodes: int = 1,
        staged: bool = False,
    ) -> None:
        assert cfg.tensor_parallel_size > 1, "a node of one rank has no link"
        self.cfg = cfg
        self.rank, self.size = rank, cfg.tensor_parallel_size
        self.store_dir = store_dir
        self.machine_nodes = machine_nodes
        self.staged = staged
        self.processes: RankProcesses | None = None
        self.group: TPGroup | None = None
        self.rank_kv: RankKV | None = None
        self.staging: StagingPool | None = None

    @property
    def pids(self) -> list[int]:
        """The other ranks' processes (rank 0; elsewhere [])."""
        return self.processes.pids if self.processes is not None else []

    def join(self, device: torch.device, deterministic: bool) -> None:
        if self.rank == 0:  # the ranks load their shards while this one loads its own
            self.processes = RankProcesses(self.cfg, self.machine_nodes)
            self.processes.start()
            self.store_dir = self.processes.store_dir
        assert self.store_dir is not None, "a rank >= 1 joins rank 0's group"
        self.group = TPGroup(
            self.rank,
            self.size,
            self.store_dir,
            device,
            self.cfg.tensor_parallel_timeout_s,
            deterministic,
        )

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        assert self.group is not None, "join first"
        return self.group.reduce(x)

    def attach(self, pool: KVPool, num_kv_heads: int) -> None:
        assert self.group is not None, "join first"
        plans = self.processes.plans if self.processes is not None else None
        self.rank_kv = RankKV(pool, None, self.group, plans, num_kv_heads)
        if self.staged and self.rank == 0:
            self.staging = StagingPool(self.rank_kv)

    def send_forward(self, seqs: Sequence[SeqInput], return_all_logits: bool) -> None:
        if self.processes is not None and self.processes.plans is not None:
            self.processes.plans.forward(seqs, return_all_logits)  # the ranks run it beside us

    @property
    def staging_pool(self) -> KVPool | None:
        return self.staging.pool if self.staging is not None else None

    def mirror(self, slots: Sequence[int]) -> None:
        assert self.staging is not None, "not staged"
        self.staging.mirror(slots)

    def host_pool(self, local: HostKVPool) -> BaseKVMover:
        assert self.rank_kv is not None, "attach first"
        self.rank_kv.host = local
        return ShardedHostKVPool(self.rank_kv, self.staging)

    def check(self) -> None:
        if self.processes is not None:
            self.processes.check()

    def close(self) -> None:
        if self.processes is not None:
            self.processes.stop()
            self.processes = None
        if self.group is not None:
            self.group.close()
            self.group = None
