"""KV copies on a tensor-parallel node: every rank holds its heads of each slot; rank 0 orders
each copy (``pd.parallel.plan``'s ``KVOp``s down the plan pipes) and every rank makes
its part of it, so slot numbers mean the same on every rank.

    RankKV            every rank: its device pool (and host pool); gathers a slot range's
                      heads to rank 0 and scatters them from it (``follow``: a rank's part)
    ShardedHostKVPool rank 0's host tier: copies between the pools on every rank; a disk
                      chunk's bytes hold every head of the model (gathered to rank 0, scattered
                      from it), so a chunk of a node of any size is read by a node of any other
    StagingPool       rank 0 of a node in a cluster: every head of every slot, in a pool the
                      transfer plane reads and writes (``mirror`` after a forward or a load
                      writes slots on the ranks; ``deliver`` after KV landed in it)

The staging pool costs rank 0 a pool of every head beside its shard: the price of moving KV
between nodes through rank 0 alone (rank pairs moving their own heads would not pay it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pd.cache.host_tier import BaseKVMover
from pd.core.kv_pool import KVPool
from pd.executor.host_pool import HostKVPool, to_bytes
from pd.model.sharding import kv_heads_of
from pd.parallel.group import TPGroup
from pd.parallel.plan import KVOp, PlanWriter


class RankKV:
    """One rank's KV (its shard of each slot), in the copies rank 0 orders."""

    def __init__(
        self,
        device: KVPool,
        host: HostKVPool | None,
        group: TPGroup,
        plans: PlanWriter | None,
        num_kv_heads: int,
    ) -> None:
        self.device, self.host = device, host
        self.group = group
        self.plans = plans  # rank 0's; None on the ranks that follow
        self.num_kv_heads = num_kv_heads  # the model's
        size = group.size
        self._heads = [kv_heads_of(num_kv_heads, r, size) for r in range(size)]
        # the first rank holding each KV head (the ranks past the heads hold copies)
        self._owners = [r for r in range(size) if r == 0 or self._heads[r] != self._heads[r - 1]]
        # a collective moves one shape from every rank: a rank of fewer heads (a size that
        # does not divide the KV heads) pads its part to the most any rank holds
        self._width = max(len(h) for h in self._heads)

    def order(self, op: KVOp, src: Sequence[int], dst: Sequence[int]) -> bool:
        """Rank 0: order ``op`` on every other rank; False (nothing ordered) for no slots."""
        assert self.plans is not None, "only rank 0 orders copies"
        if not src and not dst:
            return False
        self.plans.kv(op, src, dst)
        return True

    def follow(self, op: KVOp, src: Sequence[int], dst: Sequence[int]) -> None:
        """A rank >= 1: its part of rank 0's copy ``op``."""
        if op is KVOp.SAVE:
            self._host.save(src, dst)
        elif op is KVOp.LOAD:
            self._host.load(src, dst)
        elif op in (KVOp.GATHER_HOST, KVOp.GATHER_DEVICE):
            self.gather("host" if op is KVOp.GATHER_HOST else "device", src)
        else:
            self.scatter("host" if op is KVOp.SCATTER_HOST else "device", dst)

    @property
    def _host(self) -> HostKVPool:
        assert self.host is not None, "a host-tier copy on a node without a host tier"
        return self.host

    def _read(self, where: str, slots: Sequence[int]) -> torch.Tensor:
        # [num_layers, 2, n, this rank's heads, row_dim]
        if where == "host":
            return self._host.kv_of("host", slots)
        return _read(self.device, slots)

    def gather(self, where: str, slots: Sequence[int]) -> torch.Tensor | None:
        """Every head of ``slots`` (``[num_layers, 2, n, num_kv_heads, row_dim]``) on rank 0;
        None elsewhere."""
        parts = self.group.gather(self._padded(self._read(where, slots)))
        if not parts:
            return None
        return torch.cat([parts[r][:, :, :, : len(self._heads[r])] for r in self._owners], dim=3)

    def _padded(self, kv: torch.Tensor) -> torch.Tensor:
        """``kv`` (``[..., heads, row_dim]``) widened to ``_width`` heads, contiguous."""
        short = self._width - kv.shape[3]
        if short == 0:
            return kv.contiguous()
        return torch.cat([kv, kv.new_zeros((*kv.shape[:3], short, kv.shape[4]))], dim=3)

    def scatter(self, where: str, slots: Sequence[int], full: torch.Tensor | None = None) -> None:
        """Rank 0's ``full`` (every head of ``slots``) into each rank's heads of them."""
        d = self.device
        mine = torch.empty((d.num_layers, 2, len(slots), self._width, d.row_dim), dtype=d.dtype)
        parts: tuple[torch.Tensor, ...] = ()
        if full is not None:
            parts = tuple(self._padded(full[:, :, :, h.start : h.stop]) for h in self._heads)
        self.group.scatter(mine, parts)
        mine = mine[:, :, :, : d.num_kv_heads]
        if where == "host":
            self._host.put_kv("host", mine, slots)
        else:
            _write(self.device, mine, slots)


class ShardedHostKVPool(BaseKVMover):
    """Rank 0's host tier of a tensor-parallel node (each rank's host pool holds its heads)."""

    def __init__(self, kv: RankKV, staging: StagingPool | None = None) -> None:
        assert kv.host is not None
        self.kv = kv
        self.local = kv.host
        self.staging = staging  # a cluster node's: slots loaded here are mirrored into it
        self.num_slots = self.local.num_slots
        self.num_bytes_per_token = (
            self.local.num_bytes_per_token * kv.num_kv_heads // kv.device.num_kv_heads
        )

    def save(self, device_slots: Sequence[int], host_slots: Sequence[int]) -> None:
        if self.kv.order(KVOp.SAVE, device_slots, host_slots):
            self.local.save(device_slots, host_slots)

    def load(self, host_slots: Sequence[int], device_slots: Sequence[int]) -> None:
        if self.kv.order(KVOp.LOAD, host_slots, device_slots):
            self.local.load(host_slots, device_slots)
            self._mirror(device_slots)

    def host_bytes(self, host_slots: Sequence[int]) -> bytes:
        if not self.kv.order(KVOp.GATHER_HOST, host_slots, ()):
            return b""
        return to_bytes(self.kv.gather("host", host_slots))  # type: ignore[arg-type]

    def device_bytes(self, device_slots: Sequence[int]) -> bytes:
        if not self.kv.order(KVOp.GATHER_DEVICE, device_slots, ()):
            return b""
        return to_bytes(self.kv.gather("device", device_slots))  # type: ignore[arg-type]

    def load_bytes(self, payload: memoryview, skip: int, device_slots: Sequence[int]) -> None:
        full = self._full(payload, skip, len(device_slots))
        if self.kv.order(KVOp.SCATTER_DEVICE, (), device_slots):
            self.kv.scatter("device", device_slots, full)
            if self.staging is not None:
                _write(self.staging.pool, full, device_slots)

    def store_bytes(self, payload: memoryview, skip: int, host_slots: Sequence[int]) -> None:
        full = self._full(payload, skip, len(host_slots))
        if self.kv.order(KVOp.SCATTER_HOST, (), host_slots):
            self.kv.scatter("host", host_slots, full)

    def _full(self, payload: memoryview, skip: int, num_tokens: int) -> torch.Tensor:
        return self.local._from_bytes(payload, skip, num_tokens, self.kv.num_kv_heads)

    def _mirror(self, device_slots: Sequence[int]) -> None:
        if self.staging is not None:
            self.staging.mirror(device_slots)


class StagingPool:
    """Rank 0 of a tensor-parallel node in a cluster: every head of every slot, where the
    transfer plane sends from and receives into (the ranks' pools hold the heads it uses)."""

    def __init__(self, kv: RankKV) -> None:
        d = kv.device
        self.kv = kv
        # written before it is read (a mirror or a landed transfer): resident only as used
        self.pool = KVPool(
            d.num_layers, d.num_slots, kv.num_kv_heads, d.head_dim, d.compute_dtype, d.device,
            zeroed=False, quantize=d.quantize,
        )  # fmt: skip

    def mirror(self, slots: Sequence[int]) -> None:
        """The ranks wrote ``slots`` (a forward, a load): copy every head of them here."""
        if self.kv.order(KVOp.GATHER_DEVICE, slots, ()):
            full = self.kv.gather("device", slots)
            assert full is not None
            _write(self.pool, full, slots)

    def deliver(self, slots: Sequence[int]) -> None:
        """KV landed here in ``slots``: copy each rank's heads of them into its pool."""
        if self.kv.order(KVOp.SCATTER_DEVICE, (), slots):
            self.kv.scatter("device", slots, _read(self.pool, slots))


def _read(pool: KVPool, slots: Sequence[int]) -> torch.Tensor:
    idx = torch.tensor(slots, dtype=torch.int64, device=pool.device)
    return torch.stack(
        [
            torch.stack([k.index_select(0, idx), v.index_select(0, idx)])
            for k, v in zip(pool.k, pool.v)
        ]
    ).cpu()


def _write(pool: KVPool, kv: torch.Tensor, slots: Sequence[int]) -> None:
    dst = torch.tensor(slots, dtype=torch.int64, device=pool.device)
    for layer in range(pool.num_layers):
        pool.k[layer].index_copy_(0, dst, kv[layer, 0].to(pool.device))
        pool.v[layer].index_copy_(0, dst, kv[layer, 1].to(pool.device))
