"""One incoming transfer's record and its status (``transfer.receiver.ReceiverSide`` drives
them):

BOOTSTRAPPING (no request yet; only when the owner asked about the id first)
  -> HELD (a request came before the slot owner knew its id: kept, not refused, until the owner
     does; bounded: ``max_held_requests`` at once, each for half the handshake timeout, after
     which it is answered "no room" and back to BOOTSTRAPPING, so the sender asks again)
  -> WAITING (request accepted, slots reserved, ready sent; deadline = now + timeout_s)
  -> TRANSFERRING (start message seen; the pair worker receives and scatters)
  -> SUCCESS (done sent; the slots are now the owner's: ``landed``)

Any status before SUCCESS -> FAILED (slots released), but a failure while the worker runs the
job goes through FAILING (polls as FAILED) until the job's result, so slots are released only
once no worker job can still write into them. These are ``RecvStatus``; ``RecvRecord.move_to``
is the one place that changes it, and asserts each step is one ``_NEXT_STATUS`` allows.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from transfer.datapath import DataJob
from transfer.messages import TransferRequestMsg
from transfer.state import KVPoll, SlotReservation


class RecvStatus(enum.Enum):
    """Where one incoming transfer is; ``RecvRecord.state`` is what ``poll()`` shows of it."""

    BOOTSTRAPPING = enum.auto()  # the owner asked about the id; no request yet
    HELD = enum.auto()  # a request the owner could not place yet: answered once it can
    WAITING = enum.auto()  # slots reserved, ready sent; the job is built, not yet submitted
    TRANSFERRING = enum.auto()  # the job is on the pair: its worker may write into the slots
    SUCCESS = enum.auto()  # KV in place, done sent; the slots are the owner's
    FAILING = enum.auto()  # failed while the worker runs the job: the slots wait for its result
    FAILED = enum.auto()  # failed; the reserved slots (if any) were released

    @property
    def poll(self) -> KVPoll:
        if self == RecvStatus.HELD:
            return KVPoll.BOOTSTRAPPING
        return KVPoll.FAILED if self == RecvStatus.FAILING else KVPoll[self.name]


_NEXT_STATUS: dict[RecvStatus, frozenset[RecvStatus]] = {
    RecvStatus.BOOTSTRAPPING: frozenset({RecvStatus.HELD, RecvStatus.WAITING, RecvStatus.FAILED}),
    RecvStatus.HELD: frozenset(
        {RecvStatus.WAITING, RecvStatus.BOOTSTRAPPING, RecvStatus.FAILED}  # BOOTSTRAPPING: no room
    ),
    RecvStatus.WAITING: frozenset({RecvStatus.TRANSFERRING, RecvStatus.FAILED}),
    RecvStatus.TRANSFERRING: frozenset(
        {RecvStatus.SUCCESS, RecvStatus.FAILING, RecvStatus.FAILED}  # FAILED: job not started
    ),
    RecvStatus.FAILING: frozenset({RecvStatus.FAILED}),
    RecvStatus.SUCCESS: frozenset(),
    RecvStatus.FAILED: frozenset(),
}


@dataclass(eq=False)
class RecvRecord:
    transfer_id: str
    status: RecvStatus = RecvStatus.BOOTSTRAPPING  # changed only by ``move_to``
    deadline: float = math.inf  # no deadline until a request arrives (HELD: until when)
    identity: bytes | None = None
    prefix: str = ""
    request: TransferRequestMsg | None = None  # HELD: the request to answer
    reservation: SlotReservation | None = None
    job: DataJob | None = None
    failure: str | None = None
    finished_at: float = math.inf

    @property
    def state(self) -> KVPoll:
        return self.status.poll

    def move_to(self, status: RecvStatus) -> None:
        assert status in _NEXT_STATUS[self.status], (
            f"receive {self.transfer_id}: {self.status.name} -> {status.name}"
        )
        self.status = status

    def hold(self, identity: bytes, request: TransferRequestMsg, deadline: float) -> None:
        """-> HELD: ``request`` waits here (until ``deadline``) for the owner to know its id."""
        self.move_to(RecvStatus.HELD)
        self.identity, self.prefix, self.request = identity, request.group_prefix, request
        self.deadline = deadline

    def unhold(self) -> None:
        """HELD -> BOOTSTRAPPING: answered "no room", the sender asks again (the identity and
        group stay known, so an abort either way still reaches the other side)."""
        self.move_to(RecvStatus.BOOTSTRAPPING)
        self.request, self.deadline = None, math.inf
