"""``StagedSlotOwner``: the transfer plane's view of a tensor-parallel node's slots.

KV that lands on such a node lands in rank 0's staging pool (``pd.parallel.rank_kv``: every head
of every slot); before the node's own slot owner hears that it landed, each rank's heads of
those slots are copied into its pool. Everything else is the wrapped owner's."""

from __future__ import annotations

from collections.abc import Sequence

from pd.parallel.rank_kv import StagingPool
from transfer.state import BaseSlotOwner, SlotReservation


class StagedSlotOwner(BaseSlotOwner):
    def __init__(self, owner: BaseSlotOwner, staging: StagingPool) -> None:
        self.owner = owner
        self.staging = staging
        self._slots: dict[str, list[int]] = {}  # transfer id -> its reserved slots

    def knows(self, transfer_id: str) -> bool:
        return self.owner.knows(transfer_id)

    def reserve(
        self, transfer_id: str, num_tokens: int, token_ids: Sequence[int] | None
    ) -> SlotReservation | None:
        reservation = self.owner.reserve(transfer_id, num_tokens, token_ids)
        if reservation is not None:
            self._slots[transfer_id] = reservation.slots
        return reservation

    def release(self, transfer_id: str, reservation: SlotReservation) -> None:
        self._slots.pop(transfer_id, None)
        self.owner.release(transfer_id, reservation)

    def landed(self, transfer_id: str) -> None:
        slots = self._slots.pop(transfer_id, [])
        self.staging.deliver(slots)  # the ranks' heads, before anyone reads these slots
        self.owner.landed(transfer_id)

    @property
    def num_pending(self) -> int:
        """Reservations whose KV has not landed nor been released (0 when idle)."""
        return len(self._slots)
