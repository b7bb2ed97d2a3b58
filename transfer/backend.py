"""The data-path seam: one end of a connected two-rank pair that moves whole tensors.

``BaseTransferBackend`` is what the pair worker (``datapath.py``) drives; ``TorchPairGroup``
(``group.py``) implements it over gloo or NCCL, ``FakeTransferBackend`` over in-process queues
so that unit tests run the same state machines without torch.distributed.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


class PairError(RuntimeError):
    """The pair is unusable (timeout, peer gone, closed); the owner must build a new one."""


class Pending(ABC):
    """An operation in flight on a pair."""

    @abstractmethod
    def wait(self, timeout_s: float) -> None:
        """Block until done; raise ``PairError`` (or the backend's RuntimeError) on timeout or
        failure. After a failure the pair is broken for good."""


class BaseTransferBackend(ABC):
    """One end of a two-rank pair. Ops are matched in the order they are posted per direction,
    so a caller that posts ``isend(a); isend(b)`` and a peer that posts ``irecv(x); irecv(y)``
    get ``a -> x`` and ``b -> y``. Tensors must be contiguous, on ``device``, and must not be
    touched until their ``Pending.wait`` returns."""

    kind: str
    rank: int
    device: torch.device

    @abstractmethod
    def isend(self, tensor: torch.Tensor) -> Pending:
        """Start sending ``tensor`` to the peer."""

    @abstractmethod
    def irecv(self, tensor: torch.Tensor) -> Pending:
        """Start receiving the peer's next tensor into ``tensor`` (same numel and dtype)."""

    @abstractmethod
    def close(self) -> None:
        """Tear the pair down; later and pending ops fail. Idempotent, never blocks long."""


# --------------------------------------------------------------------------- fake backend


@dataclass
class _FakeLink:
    # queues[r]: tensors sent by rank r, read by rank 1 - r
    queues: tuple[queue.Queue[torch.Tensor | None], queue.Queue[torch.Tensor | None]] = field(
        default_factory=lambda: (queue.Queue(), queue.Queue())
    )
    closed: bool = False


_FAKE_LINKS: dict[str, _FakeLink] = {}
_FAKE_LOCK = threading.Lock()


class _Done(Pending):
    def wait(self, timeout_s: float) -> None:
        return None


class _FakeRecv(Pending):
    def __init__(self, link: _FakeLink, src: int, out: torch.Tensor) -> None:
        self._link, self._src, self._out = link, src, out

    def wait(self, timeout_s: float) -> None:
        try:
            data = self._link.queues[self._src].get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            self._link.closed = True  # like gloo: a timed-out wait kills the pair
            raise PairError(f"fake recv timed out after {timeout_s:.3f} s") from None
        if data is None:
            raise PairError("fake pair closed by peer")
        if data.numel() != self._out.numel() or data.dtype != self._out.dtype:
            self._link.closed = True
            raise PairError(
                f"fake recv size mismatch: got {data.numel()} {data.dtype}, "
                f"posted {self._out.numel()} {self._out.dtype}"
            )
        self._out.copy_(data.view_as(self._out))


class FakeTransferBackend(BaseTransferBackend):
    """In-process pair: both ends live in one process and meet under the same ``prefix``."""

    kind = "fake"

    def __init__(self, prefix: str, rank: int, device: torch.device | str = "cpu") -> None:
        assert rank in (0, 1), rank
        with _FAKE_LOCK:
            self._link = _FAKE_LINKS.setdefault(prefix, _FakeLink())
        self._prefix = prefix
        self.rank = rank
        self.device = torch.device(device)
        self.send_delay_s = 0.0  # tests slow the data path down with this

    def isend(self, tensor: torch.Tensor) -> Pending:
        if self._link.closed:
            raise PairError(f"fake pair {self._prefix} is closed")
        if self.send_delay_s:
            time.sleep(self.send_delay_s)
        self._link.queues[self.rank].put(tensor.detach().clone())
        return _Done()

    def irecv(self, tensor: torch.Tensor) -> Pending:
        if self._link.closed:
            raise PairError(f"fake pair {self._prefix} is closed")
        return _FakeRecv(self._link, 1 - self.rank, tensor)

    def close(self) -> None:
        self._link.closed = True
        # Wake a peer blocked in a receive.
        self._link.queues[self.rank].put(None)
        with _FAKE_LOCK:
            _FAKE_LINKS.pop(self._prefix, None)
