"""Config, poll states and the slot-owner seam shared by both sides of a transfer."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, Protocol, TypeVar

from transfer import conn_cap, inbound
from transfer.auth import DEFAULT_MAX_AGE_S, check_secret, new_secret
from transfer.endpoint import check_host


class KVPoll(enum.IntEnum):
    """What ``poll()`` returns. SUCCESS and FAILED are final."""

    BOOTSTRAPPING = 0  # handshake: asking the receiver for slots (or waiting to be asked)
    WAITING = 1  # slots reserved on the receiver; the sender has not started the data
    TRANSFERRING = 2  # data on the pair (sender: until the receiver's ack)
    SUCCESS = 3  # receiver: KV is in the destination slots, now the owner's
    FAILED = 4  # see ``failure``; the receiver's reserved slots are (or will be) released

    @property
    def is_final(self) -> bool:
        return self >= KVPoll.SUCCESS


@dataclass(frozen=True)
class TransferConfig:
    # the address this node's control socket, store and pair groups bind and advertise: one
    # other machines can dial (never 0.0.0.0)
    host: str = "127.0.0.1"
    port: int = 0  # control (ROUTER) port; 0 = a free one
    backend: str = "auto"  # auto (nccl for CUDA buffers, else gloo) | gloo | nccl | fake
    handshake_timeout_s: float = field(
        default=10.0, metadata={"help": "KV transfer: request -> slots reserved, retries included"}
    )
    retry_interval_s: float = 0.02  # between requests after a "no room" answer
    # requests for ids the receiver's slot owner does not know yet, held until it does (each
    # for at most half the handshake timeout; beyond this many: "no room", and the sender retries)
    max_held_requests: int = 1024
    timeout_s: float = field(
        default=30.0, metadata={"help": "KV transfer: slots reserved -> KV in place (each side)"}
    )
    connect_timeout_s: float = field(
        default=10.0, metadata={"help": "KV transfer: rendezvous of a new pair group"}
    )
    linger_s: float = 60.0  # finished transfers stay pollable (by id) this long
    # The cluster secret every control frame and pair rendezvous is authenticated with
    # (``auth.py``): every member must get the same one, through Ray, never on a command line.
    secret: bytes = field(default_factory=new_secret, repr=False)
    max_msg_age_s: float = DEFAULT_MAX_AGE_S  # a frame stamped further from our clock is refused
    # control frames longer are dropped unread (inbound.py); a node sizes it from its
    # max_model_len
    max_frame_bytes: int = inbound.max_frame_bytes(inbound.DEFAULT_MAX_TOKENS)
    max_conns: int = field(
        default=conn_cap.MAX_CONNS,
        metadata={
            "help": "TCP connections each internal socket (the server's, a node's inbox and "
            "transfer port) takes at once, more are cut: bounds what strangers can make it "
            "hold; must exceed the number of nodes"
        },
    )

    def __post_init__(self) -> None:
        check_host(self.host)
        check_secret(self.secret)
        if self.backend not in ("auto", "gloo", "nccl", "fake"):
            raise ValueError(f"backend must be auto, gloo, nccl or fake, got {self.backend!r}")
        for name in ("handshake_timeout_s", "timeout_s", "connect_timeout_s", "max_msg_age_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_frame_bytes < inbound.FRAME_MARGIN_BYTES:
            raise ValueError(
                f"max_frame_bytes must be >= {inbound.FRAME_MARGIN_BYTES}, got {self.max_frame_bytes}"
            )
        if self.max_conns < 2:
            raise ValueError(
                f"max_conns must be >= 2 (the server and a peer), got {self.max_conns}"
            )
        if self.max_held_requests < 0:
            raise ValueError(f"max_held_requests must be >= 0, got {self.max_held_requests}")
        if self.retry_interval_s < 0 or self.linger_s < 0:
            raise ValueError(
                f"retry_interval_s ({self.retry_interval_s}) and linger_s ({self.linger_s}) "
                "must be >= 0"
            )


class TransferRecord(Protocol):
    """What a handle reads of either side's per-transfer record."""

    transfer_id: str
    failure: str | None

    @property
    def state(self) -> KVPoll: ...


SideT = TypeVar("SideT")
RecordT = TypeVar("RecordT", bound=TransferRecord)


class TransferHandle(Generic[SideT, RecordT]):
    """Handle of one transfer (``KVSender``, ``KVReceiver``): a view of its side's record.
    Every method returns at once; ``poll()`` first drives the agent's progress."""

    def __init__(self, side: SideT, rec: RecordT, progress: Callable[[], None]) -> None:
        self._side, self._rec, self._progress = side, rec, progress

    @property
    def transfer_id(self) -> str:
        return self._rec.transfer_id

    @property
    def failure(self) -> str | None:
        return self._rec.failure

    def poll(self) -> KVPoll:
        self._progress()
        return self._rec.state


class SlotReservation(NamedTuple):
    slots: list[int]  # destination slots of tokens [num_cached_tokens, num_tokens)
    num_cached_tokens: int = 0  # leading tokens the receiver already holds


class BaseSlotOwner(ABC):
    """The receiving node's slot allocator (and cache), as the transfer agent sees it.

    Every method is called on the thread that calls ``TransferAgent.progress()``, so a plain
    non-thread-safe allocator is fine. Each reservation ends in exactly one ``landed`` or one
    ``release``.
    """

    def knows(self, transfer_id: str) -> bool:
        """False: no request for ``transfer_id`` has reached the owner yet (its own message is
        still on the way), so a transfer request for it is held, not refused, and ``reserve``
        is asked once this turns True. Bounded: past ``TransferConfig.max_held_requests`` held
        at once, or half the handshake timeout, it is answered "no room" (the sender asks
        again). True by default."""
        return True

    @abstractmethod
    def reserve(
        self, transfer_id: str, num_tokens: int, token_ids: Sequence[int] | None
    ) -> SlotReservation | None:
        """Slots for the last ``num_tokens - num_cached_tokens`` tokens, or None for "no room"
        (the sender retries). Anything taken for ``transfer_id`` (a locked cached prefix) is
        the owner's until ``release`` or until the transfer succeeds."""

    @abstractmethod
    def release(self, transfer_id: str, reservation: SlotReservation) -> None:
        """The transfer failed or was aborted: free ``reservation.slots`` (and unlock a prefix).
        Called exactly once per failed reservation, and only when no data thread can still
        write into those slots. Never called after SUCCESS: the slots then belong to the owner."""

    def landed(self, transfer_id: str) -> None:
        """The transfer succeeded: the KV is in the reserved slots, which are the owner's from
        now on (no data thread writes them any more). Called once, instead of ``release``.
        Nothing by default (an owner may poll instead)."""
        return None


class CallbackSlotOwner(BaseSlotOwner):
    """A ``BaseSlotOwner`` from plain callables, e.g. a ``SlotAllocator``:

    ``CallbackSlotOwner(lambda n: a.allocate(n) if a.can_allocate(n) else None, a.free)``

    ``match_prefix(token_ids) -> int`` (optional) says how many leading tokens are already
    held; it must not lock anything (use ``BaseSlotOwner`` directly for that).
    """

    def __init__(
        self,
        allocate: Callable[[int], list[int] | None],
        free: Callable[[list[int]], None],
        match_prefix: Callable[[Sequence[int]], int] | None = None,
    ) -> None:
        self._allocate, self._free, self._match_prefix = allocate, free, match_prefix

    def reserve(
        self, transfer_id: str, num_tokens: int, token_ids: Sequence[int] | None
    ) -> SlotReservation | None:
        num_cached = 0
        if self._match_prefix is not None and token_ids is not None:
            num_cached = min(self._match_prefix(token_ids), num_tokens)
        slots = self._allocate(num_tokens - num_cached) if num_tokens > num_cached else []
        return None if slots is None else SlotReservation(list(slots), num_cached)

    def release(self, transfer_id: str, reservation: SlotReservation) -> None:
        if reservation.slots:
            self._free(reservation.slots)
