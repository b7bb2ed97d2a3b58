"""The torch side of the host tier (``pd.cache.host_tier``): a host KV pool beside the device
pool, and the copies between them.

The host pool has the device pool's layout (per layer K and V, ``[num_slots, num_kv_heads,
head_dim]``, the same dtype), allocated with ``torch.empty``: its pages become resident only as
the tier fills them, so a large tier costs memory only when used. On CUDA it is pinned, so the
copies are DMA.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from pd.cache.disk_tier import DiskTier, model_key
from pd.cache.host_tier import BaseKVMover
from pd.core.kv_pool import KVPool
from pd.engine.config import EngineConfig
from pd.model.loader import weights_digest

DEFAULT_POOL_MULTIPLE = 4  # the host tier's default slots, in device pools
DEFAULT_MEMORY_SHARE = 8  # ... at most 1/8 of the machine's memory per tier


DISK_CHUNK_TOKENS = 64  # a disk chunk's tokens (rounded up to whole pages)


def make_disk_tier(
    cfg: EngineConfig, model_dir: Path, pool: KVPool, quantization: str
) -> DiskTier | None:
    """The disk tier ``cfg`` asks for, keyed by the contents of the checkpoint's weights and
    config, the weight format, the KV layout and the page and chunk sizes; None without
    ``disk_cache_dir``. A directory another user could write is refused (``InsecurePathError``);
    one that fails gives a tier that is off (logged, in the node's stats)."""
    if cfg.disk_cache_dir is None:
        return None
    ps = cfg.page_size
    chunk = -(-DISK_CHUNK_TOKENS // ps) * ps
    config = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()
    key = model_key(
        config, weights_digest(model_dir), str(pool.dtype), quantization, cfg.linear_backend,
        pool.num_layers, pool.num_kv_heads, pool.head_dim, ps, chunk,
    )  # fmt: skip
    max_bytes = int(cfg.disk_cache_gb * 2**30)
    return DiskTier(Path(cfg.disk_cache_dir).expanduser(), key, chunk, max_bytes)


def host_tier_slots(cfg: EngineConfig, num_bytes_per_token: int) -> int:
    """The host tier's slots for ``cfg``: as set, or by default ``DEFAULT_POOL_MULTIPLE``
    device pools, bounded by a share of physical memory (0: no tier)."""
    if not cfg.enable_prefix_cache:
        return 0
    if cfg.host_cache_tokens is not None:
        return cfg.host_cache_tokens
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    by_memory = memory // DEFAULT_MEMORY_SHARE // max(1, num_bytes_per_token)
    return min(DEFAULT_POOL_MULTIPLE * cfg.max_total_tokens, by_memory)


class HostKVPool(BaseKVMover):
    """``num_slots`` host slots for the KV of ``device``'s slots."""

    def __init__(self, device: KVPool, num_slots: int) -> None:
        self.device = device
        self.num_slots = num_slots
        self.num_bytes_per_token = device.num_bytes_per_token
        pin = device.device.type == "cuda"
        shape = (num_slots, device.num_kv_heads, device.head_dim)
        self.k = [torch.empty(shape, dtype=device.dtype, pin_memory=pin) for _ in device.k]
        self.v = [torch.empty(shape, dtype=device.dtype, pin_memory=pin) for _ in device.v]

    def save(self, device_slots: Sequence[int], host_slots: Sequence[int]) -> None:
        src = torch.tensor(device_slots, dtype=torch.int64, device=self.device.device)
        dst = torch.tensor(host_slots, dtype=torch.int64)
        for layer in range(self.device.num_layers):
            # [n, num_kv_heads, head_dim] gathered on the device, then one copy down
            self.k[layer].index_copy_(0, dst, self.device.k[layer].index_select(0, src).cpu())
            self.v[layer].index_copy_(0, dst, self.device.v[layer].index_select(0, src).cpu())

    def load(self, host_slots: Sequence[int], device_slots: Sequence[int]) -> None:
        src = torch.tensor(host_slots, dtype=torch.int64)
        dev = self.device.device
        dst = torch.tensor(device_slots, dtype=torch.int64, device=dev)
        for layer in range(self.device.num_layers):
            k = self.k[layer].index_select(0, src)
            v = self.v[layer].index_select(0, src)
            self.device.k[layer].index_copy_(0, dst, k.to(dev, non_blocking=True))
            self.device.v[layer].index_copy_(0, dst, v.to(dev, non_blocking=True))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def host_bytes(self, host_slots: Sequence[int]) -> bytes:
        return _as_bytes(self.k, self.v, host_slots)

    def device_bytes(self, device_slots: Sequence[int]) -> bytes:
        return _as_bytes(self.device.k, self.device.v, device_slots)

    def _from_bytes(self, payload: memoryview) -> torch.Tensor:
        d = self.device
        kv = torch.frombuffer(payload, dtype=torch.uint8).view(d.dtype)  # no copy
        return kv.view(d.num_layers, 2, -1, d.num_kv_heads, d.head_dim)

    def load_bytes(self, payload: memoryview, skip: int, device_slots: Sequence[int]) -> None:
        kv = self._from_bytes(payload)[:, :, skip:]
        assert kv.shape[2] == len(device_slots), (kv.shape, len(device_slots))
        dev = self.device.device
        dst = torch.tensor(device_slots, dtype=torch.int64, device=dev)
        for layer in range(self.device.num_layers):
            self.device.k[layer].index_copy_(0, dst, kv[layer, 0].to(dev))
            self.device.v[layer].index_copy_(0, dst, kv[layer, 1].to(dev))

    def store_bytes(self, payload: memoryview, skip: int, host_slots: Sequence[int]) -> None:
        kv = self._from_bytes(payload)[:, :, skip:]
        assert kv.shape[2] == len(host_slots), (kv.shape, len(host_slots))
        dst = torch.tensor(host_slots, dtype=torch.int64)
        for layer in range(self.device.num_layers):
            self.k[layer].index_copy_(0, dst, kv[layer, 0])
            self.v[layer].index_copy_(0, dst, kv[layer, 1])


def _as_bytes(k: list[torch.Tensor], v: list[torch.Tensor], slots: Sequence[int]) -> bytes:
    """The K and V of ``slots`` in every layer, ``[num_layers, 2, n, num_kv_heads, head_dim]``,
    as raw bytes."""
    idx = torch.tensor(slots, dtype=torch.int64, device=k[0].device)
    kv = torch.stack([torch.stack([kl.index_select(0, idx), vl.index_select(0, idx)])
                      for kl, vl in zip(k, v)])  # fmt: skip
    return kv.cpu().view(torch.uint8).numpy().tobytes()
