"""Shared builders for the transfer tests (also imported by spawned child processes)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from pd.core.kv_pool import KVPool, SlotAllocator
from transfer.agent import TransferAgent
from transfer.state import BaseSlotOwner, SlotReservation

NUM_LAYERS, NUM_SLOTS, NUM_HEADS, HEAD_DIM = 3, 64, 2, 4


def make_pool(seed: int | None, num_slots: int = NUM_SLOTS, device: str = "cpu") -> KVPool:
    """A small pool; ``seed`` fills it with reproducible noise, None with a -7 sentinel."""
    pool = KVPool(NUM_LAYERS, num_slots, NUM_HEADS, HEAD_DIM, device=device)
    gen = torch.Generator().manual_seed(seed if seed is not None else 0)
    for t in pool.k + pool.v:
        if seed is None:
            t.fill_(-7.0)
        else:
            t.copy_(torch.randn(t.shape, generator=gen))
    return pool


def buffers(pool: KVPool) -> list[torch.Tensor]:
    return pool.k + pool.v


class TrackingOwner(BaseSlotOwner):
    """A SlotAllocator as a slot owner, remembering what it handed out; ``cached`` maps a
    token-id prefix (tuple) to the number of leading tokens it pretends to hold."""

    def __init__(self, num_slots: int = NUM_SLOTS) -> None:
        self.alloc = SlotAllocator(num_slots)
        self.reserved: dict[str, list[int]] = {}
        self.released: list[str] = []
        self.cached: dict[tuple[int, ...], int] = {}

    def reserve(
        self, transfer_id: str, num_tokens: int, token_ids: Sequence[int] | None
    ) -> SlotReservation | None:
        num_cached = 0
        if token_ids is not None:
            for prefix, n in self.cached.items():
                if tuple(token_ids[: len(prefix)]) == prefix:
                    num_cached = max(num_cached, n)
        if not self.alloc.can_allocate(num_tokens - num_cached):
            return None
        slots = self.alloc.allocate(num_tokens - num_cached)
        self.reserved[transfer_id] = slots
        return SlotReservation(slots, num_cached)

    def release(self, transfer_id: str, reservation: SlotReservation) -> None:
        assert self.reserved.pop(transfer_id) == reservation.slots, "released foreign slots"
        self.released.append(transfer_id)
        self.alloc.free(reservation.slots)

    def take(self, transfer_id: str) -> list[int]:
        """The owner takes a succeeded transfer's slots (and may free them later)."""
        return self.reserved.pop(transfer_id)

    def check(self) -> None:
        self.alloc.check_integrity(self.reserved.values())


def run_until(pred: Callable[[], bool], agents: Sequence[TransferAgent], timeout_s: float) -> bool:
    """Drive ``agents`` like a node loop would until ``pred()`` or the timeout."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for a in agents:
            a.progress()
        if pred():
            return True
        time.sleep(0.001)
    return False


def assert_moved(
    src: KVPool, src_slots: Sequence[int], dst: KVPool, dst_slots: Sequence[int]
) -> None:
    s, d = torch.tensor(list(src_slots)), torch.tensor(list(dst_slots))
    for a, b in zip(buffers(src), buffers(dst), strict=True):
        assert torch.equal(a.cpu()[s], b.cpu()[d])


def assert_untouched(dst: KVPool, written: Sequence[int]) -> None:
    keep = torch.ones(dst.num_slots, dtype=torch.bool)
    keep[list(written)] = False
    for b in buffers(dst):
        assert bool((b.cpu()[keep] == -7.0).all()), "a slot outside the destination was written"
