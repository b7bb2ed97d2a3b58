"""The torch side of the host tier (``pd.cache.host_tier``): a host KV pool beside the device
pool, and the copies between them.

The host pool has the device pool's layout (per layer K and V, ``[num_slots, num_kv_heads,
row_dim]``, the same dtype: an int8 pool's codes and scales), allocated with ``torch.empty``:
its pages become resident only as the tier fills them, so a large tier costs memory only when
used. It is never pinned as a whole (pinned pages are resident and locked from the start): on
CUDA each copy goes through a pinned staging buffer of that copy's size, pinned when first used
and reused after (torch's caching host allocator), so the copies are DMA.

Its default size (``host_tier_slots``): ``DEFAULT_POOL_MULTIPLE`` device pools, at most
1/``DEFAULT_MEMORY_SHARE`` of this node's share of the machine's memory, that is of the
machine's memory (physical, or its cgroup's limit where lower: ``machine_memory_bytes``) over
the pd nodes that may share the machine (``NodeConfig.machine_nodes``, which the launcher sets).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from pd.cache.chunk_file import model_key
from pd.cache.disk_tier import DiskTier
from pd.cache.host_tier import BaseKVMover
from pd.core.kv_pool import KVPool
from pd.executor.config import DEFAULT_KV_TOKENS, EngineConfig
from pd.model.loader import weights_digest

DEFAULT_POOL_MULTIPLE = 4  # the host tier's default slots, in device pools
DEFAULT_MEMORY_SHARE = 8  # ... at most 1/8 of this node's share of the machine's memory
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


DISK_CHUNK_TOKENS = 64  # a disk chunk's tokens (rounded up to whole pages)


def make_disk_tier(
    cfg: EngineConfig, model_dir: Path, pool: KVPool, quantization: str, num_kv_heads: int
) -> DiskTier | None:
    """The disk tier ``cfg`` asks for, keyed by the contents of the checkpoint's weights and
    config, the weight format, the KV layout (every KV head of the model: a tensor-parallel
    node's chunks hold them all) and the page and chunk sizes; None without
    ``disk_cache_dir``. A directory another user could write, or one under such a parent, is
    refused (``InsecurePathError``); one that fails gives a tier that is off (logged, in the
    node's stats)."""
    if cfg.disk_cache_dir is None:
        return None
    ps = cfg.page_size
    chunk = -(-DISK_CHUNK_TOKENS // ps) * ps
    config = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()
    key = model_key(
        config, weights_digest(model_dir), pool.kv_format, quantization, cfg.linear_backend,
        pool.num_layers, num_kv_heads, pool.row_dim, ps, chunk,
    )  # fmt: skip
    max_bytes = int(cfg.disk_cache_gb * 2**30)
    return DiskTier(
        Path(cfg.disk_cache_dir).expanduser(), key, chunk, max_bytes,
        min_free_bytes=int(cfg.disk_cache_min_free_gb * 2**30),
        min_free_fraction=cfg.disk_cache_min_free_percent / 100,
    )  # fmt: skip


def cgroup_memory_limit(root: Path | None = None, self_cgroup: Path | None = None) -> int | None:
    """The lowest memory limit of this process's cgroup and its ancestors, in bytes: cgroup
    v2's ``memory.max`` ("max": none), else v1's ``memory.limit_in_bytes``; None when there is
    none (or no cgroup file system). The cgroup is read from ``self_cgroup`` (``0::/path`` in v2,
    ``N:...memory...:/path`` in v1), under ``root``; in a container (its own cgroup namespace)
    the path is ``/`` and ``root`` holds its limit. Defaults: ``CGROUP_ROOT``,
    ``PROC_SELF_CGROUP``."""
    root = root or CGROUP_ROOT
    try:
        lines = (self_cgroup or PROC_SELF_CGROUP).read_text().splitlines()
    except OSError:
        return None
    dirs: list[tuple[Path, str]] = []  # (the cgroup's directory, its limit file's name)
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2's unified hierarchy
            dirs.append((root / path.lstrip("/"), "memory.max"))
        elif "memory" in controllers.split(","):
            dirs.append((root / "memory" / path.lstrip("/"), "memory.limit_in_bytes"))
    limits: list[int] = []
    for start, name in dirs:
        top = root if name == "memory.max" else root / "memory"
        for d in [start, *start.parents]:
            with contextlib.suppress(OSError, ValueError):  # no such file, or "max"
                limits.append(int((d / name).read_text().strip()))
            if d == top or top not in d.parents:
                break
    return min(limits, default=None)


def machine_memory_bytes() -> int:
    """This machine's memory for pd: physical memory, or the cgroup's limit where lower (v1
    writes "no limit" as a number near 2**63: the minimum ignores it)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_memory_limit()
    return physical if limit is None else min(physical, limit)


def host_tier_slots(
    cfg: EngineConfig,
    num_bytes_per_token: int,
    machine_nodes: int = 1,
    pool_slots: int | None = None,
) -> int:
    """The host tier's slots for ``cfg``: as set, or by default ``DEFAULT_POOL_MULTIPLE``
    device pools (``pool_slots`` each; default ``max_total_tokens`` or its default), at most
    1/``DEFAULT_MEMORY_SHARE`` of the machine's memory over the ``machine_nodes`` pd nodes that
    may share it (0: no tier). Both count bytes: an int8 pool's tier holds its slots."""
    if machine_nodes < 1:
        raise ValueError(f"machine_nodes must be >= 1, got {machine_nodes}")
    if not cfg.enable_prefix_cache:
        return 0
    if cfg.host_cache_tokens is not None:
        return cfg.host_cache_tokens
    share = machine_memory_bytes() // machine_nodes
    by_memory = share // DEFAULT_MEMORY_SHARE // max(1, num_bytes_per_token)
    if pool_slots is None:
        pool_slots = cfg.max_total_tokens or DEFAULT_KV_TOKENS
    return min(DEFAULT_POOL_MULTIPLE * pool_slots, by_memory)


class HostKVPool(BaseKVMover):
    """``num_slots`` host slots for the KV of ``device``'s slots."""

    def __init__(self, device: KVPool, num_slots: int) -> None:
        self.device = device
        self.num_slots = num_slots
        self.num_bytes_per_token = device.num_bytes_per_token
        # the pool itself is never pinned: its pages stay lazy (the module docstring)
        self._pin = device.device.type == "cuda"
        shape = (num_slots, device.num_kv_heads, device.row_dim)
        self.k = [torch.empty(shape, dtype=device.dtype) for _ in device.k]
        self.v = [torch.empty(shape, dtype=device.dtype) for _ in device.v]

    def _staged(self, num_slots: int) -> torch.Tensor | None:
        """On CUDA, a host buffer for ``num_slots`` slots of one layer's K or V, pinned (torch's
        caching host allocator pins a block when first asked and reuses it after), so a copy
        to or from the device is DMA; None on a CPU (no copy to stage)."""
        if not self._pin:
            return None
        d = self.device
        shape = (num_slots, d.num_kv_heads, d.row_dim)
        return torch.empty(shape, dtype=d.dtype, pin_memory=True)

    def save(self, device_slots: Sequence[int], host_slots: Sequence[int]) -> None:
        src = torch.tensor(device_slots, dtype=torch.int64, device=self.device.device)
        dst = torch.tensor(host_slots, dtype=torch.int64)
        for layer in range(self.device.num_layers):
            for host, dev_kv in ((self.k[layer], self.device.k[layer]),
                                 (self.v[layer], self.device.v[layer])):  # fmt: skip
                # [n, num_kv_heads, head_dim] gathered on the device, one copy down (into the
                # pinned buffer on CUDA), then scattered into the pool
                kv = dev_kv.index_select(0, src)
                if (staged := self._staged(len(device_slots))) is not None:
                    kv = staged.copy_(kv)
                host.index_copy_(0, dst, kv)

    def load(self, host_slots: Sequence[int], device_slots: Sequence[int]) -> None:
        src = torch.tensor(host_slots, dtype=torch.int64)
        dev = self.device.device
        dst = torch.tensor(device_slots, dtype=torch.int64, device=dev)
        for layer in range(self.device.num_layers):
            for host, dev_kv in ((self.k[layer], self.device.k[layer]),
                                 (self.v[layer], self.device.v[layer])):  # fmt: skip
                # gathered on the host (into the pinned buffer on CUDA), one copy up: async
                # from pinned memory, the allocator keeping the buffer until it is done
                staged = self._staged(len(host_slots))
                kv = (
                    host.index_select(0, src)
                    if staged is None
                    else torch.index_select(host, 0, src, out=staged)
                )
                dev_kv.index_copy_(0, dst, kv.to(dev, non_blocking=True))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def host_bytes(self, host_slots: Sequence[int]) -> bytes:
        return to_bytes(self.kv_of("host", host_slots))

    def device_bytes(self, device_slots: Sequence[int]) -> bytes:
        return to_bytes(self.kv_of("device", device_slots))

    def load_bytes(self, payload: memoryview, skip: int, device_slots: Sequence[int]) -> None:
        self.put_kv("device", self._from_bytes(payload, skip, len(device_slots)), device_slots)

    def store_bytes(self, payload: memoryview, skip: int, host_slots: Sequence[int]) -> None:
        self.put_kv("host", self._from_bytes(payload, skip, len(host_slots)), host_slots)

    def kv_of(self, where: str, slots: Sequence[int]) -> torch.Tensor:
        """The K and V of ``slots`` of the host or device pool, ``[num_layers, 2, n,
        num_kv_heads, row_dim]`` on the CPU (int8 rows: codes and scales)."""
        k, v = (self.k, self.v) if where == "host" else (self.device.k, self.device.v)
        idx = torch.tensor(slots, dtype=torch.int64, device=k[0].device)
        kv = torch.stack([torch.stack([kl.index_select(0, idx), vl.index_select(0, idx)])
                          for kl, vl in zip(k, v)])  # fmt: skip
        return kv.cpu()

    def put_kv(self, where: str, kv: torch.Tensor, slots: Sequence[int]) -> None:
        """``kv_of``'s inverse: ``kv`` (``[num_layers, 2, n, heads, row_dim]``) into ``slots``."""
        k, v = (self.k, self.v) if where == "host" else (self.device.k, self.device.v)
        dev = k[0].device
        dst = torch.tensor(slots, dtype=torch.int64, device=dev)
        for layer in range(self.device.num_layers):
            k[layer].index_copy_(0, dst, kv[layer, 0].to(dev))
            v[layer].index_copy_(0, dst, kv[layer, 1].to(dev))

    def _from_bytes(
        self, payload: memoryview, skip: int, num_tokens: int, num_kv_heads: int | None = None
    ) -> torch.Tensor:
        d = self.device
        heads = num_kv_heads or d.num_kv_heads
        kv = torch.frombuffer(payload, dtype=torch.uint8).view(d.dtype)  # no copy
        kv = kv.view(d.num_layers, 2, -1, heads, d.row_dim)[:, :, skip:]
        assert kv.shape[2] == num_tokens, (kv.shape, num_tokens)
        return kv


def to_bytes(kv: torch.Tensor) -> bytes:
    return kv.contiguous().view(torch.uint8).numpy().tobytes()
