"""Admission control: a limit on requests in flight and a bounded FIFO queue in front of it.

A request comes here once its whole body is in (``pd.server.routes.common``): a client that
trickles its body never holds a place.

1. A request arrives: a free place -> it is admitted at once (``AdmissionTicket``).
2. No free place -> it waits in the queue, in arrival order; a full queue -> 429 at once.
3. A finishing request hands its place straight to the oldest waiter (no polling).
4. A waiter that leaves (its client disconnected: ``ServerState.admit`` watches) or reaches
   its deadline leaves the queue at once; if a place was handed to it in the same instant, it
   passes the place on.
5. ``wait_empty`` returns once no place is held and nobody waits (a graceful shutdown);
   ``close`` refuses every waiter and every later request (a shutdown past its grace).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from pd.server.errors import APIError
from pd.server.metrics import ServerMetrics

RETRY_AFTER_S = 1


class AdmissionTicket:
    """One admitted request's place; ``release()`` gives it back (idempotent)."""

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission

    def release(self) -> None:
        admission, self._admission = self._admission, None
        if admission is not None:
            admission._release()


class Admission:
    def __init__(self, max_inflight: int, max_queued: int, metrics: ServerMetrics) -> None:
        assert max_inflight >= 1 and max_queued >= 0, (max_inflight, max_queued)
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.metrics = metrics
        self.num_inflight = 0
        # each waiter's future: True when a place is handed to it, False when it is refused
        self._waiters: deque[asyncio.Future[bool]] = deque()
        self._refusal: Callable[[], APIError] | None = None  # set by close()
        self._empty = asyncio.Event()
        self._empty.set()

    @property
    def num_queued(self) -> int:
        return len(self._waiters)

    @property
    def is_empty(self) -> bool:
        return self.num_inflight == 0 and not self._waiters

    def try_admit(self) -> AdmissionTicket | None:
        """A place now, or None when the request would have to wait."""
        if self.num_inflight < self.max_inflight and not self._waiters:
            self.num_inflight += 1
            self._update_gauges()
            return AdmissionTicket(self)
        return None

    async def admit(self, timeout_s: float) -> AdmissionTicket:
        """A place, now or after waiting in line; 429 when the line is full, 504 when
        ``timeout_s`` passes first, ``close``'s refusal once closed."""
        if self._refusal is not None:
            raise self._refusal()
        if (ticket := self.try_admit()) is not None:
            return ticket
        if len(self._waiters) >= self.max_queued:
            self.metrics.rejected.labels(reason="queue_full").inc()
            raise APIError(
                f"server overloaded: {self.num_inflight} requests in flight and "
                f"{len(self._waiters)} queued (limits {self.max_inflight} and "
                f"{self.max_queued}); retry later",
                status_code=429,
                type="rate_limit_error",
                code="server_overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._update_gauges()
        start = time.perf_counter()
        try:
            await asyncio.wait({fut}, timeout=max(timeout_s, 0.0))
        except BaseException:  # cancelled: the client left while waiting
            if not fut.done():
                self._leave(fut)
            elif fut.result():
                self._release()  # a place arrived as we were cancelled: pass it on
            raise
        if not fut.done():
            self._leave(fut)
            self.metrics.rejected.labels(reason="timeout").inc()
            raise APIError(
                f"request timed out after {timeout_s:.1f} s waiting for admission",
                status_code=504,
                type="timeout_error",
                code="request_timeout",
            )
        if not fut.result():
            assert self._refusal is not None
            raise self._refusal()
        self.metrics.queue_wait.observe(time.perf_counter() - start)
        return AdmissionTicket(self)

    def close(self, refusal: Callable[[], APIError]) -> None:
        """Refuse every waiter, and every later request, with ``refusal()``."""
        self._refusal = refusal
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(False)
        self._update_gauges()

    def _release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(True)  # the place moves to the waiter: num_inflight unchanged
                self._update_gauges()
                return
        self.num_inflight -= 1
        assert self.num_inflight >= 0, self.num_inflight
        self._update_gauges()

    def _leave(self, fut: asyncio.Future[bool]) -> None:
        fut.cancel()
        self._waiters.remove(fut)
        self._update_gauges()

    async def wait_empty(self) -> None:
        """Return once no place is held and nobody waits."""
        await self._empty.wait()

    def _update_gauges(self) -> None:  # after every change
        self.metrics.admitted.set(self.num_inflight)
        self.metrics.queued.set(len(self._waiters))
        if self.is_empty:
            self._empty.set()
        else:
            self._empty.clear()
