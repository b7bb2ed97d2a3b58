"""Admission control: a limit on requests in flight and a bounded FIFO queue in front of it.

1. A request arrives: a free place -> it is admitted at once (``AdmissionTicket``).
2. No free place -> it waits in the queue, in arrival order; a full queue -> 429 at once.
3. A finishing request hands its place straight to the oldest waiter (no polling).
4. A waiter that leaves (client gone) or reaches its deadline leaves the queue; if a place
   was handed to it in the same instant, it passes the place on.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

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
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def num_queued(self) -> int:
        return len(self._waiters)

    async def admit(self, timeout_s: float) -> AdmissionTicket:
        """A place, now or after waiting in line; 429 when the line is full, 504 when
        ``timeout_s`` passes first."""
        if self.num_inflight < self.max_inflight and not self._waiters:
            self.num_inflight += 1
            self._update_gauges()
            return AdmissionTicket(self)
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
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._update_gauges()
        start = time.perf_counter()
        try:
            await asyncio.wait({fut}, timeout=max(timeout_s, 0.0))
        except BaseException:  # cancelled: the client left while waiting
            if fut.done():
                self._release()  # a place arrived as we were cancelled: pass it on
            else:
                self._leave(fut)
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
        self.metrics.queue_wait.observe(time.perf_counter() - start)
        return AdmissionTicket(self)

    def _release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the place moves to the waiter: num_inflight unchanged
                self._update_gauges()
                return
        self.num_inflight -= 1
        assert self.num_inflight >= 0, self.num_inflight
        self._update_gauges()

    def _leave(self, fut: asyncio.Future[None]) -> None:
        fut.cancel()
        self._waiters.remove(fut)
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.admitted.set(self.num_inflight)
        self.metrics.queued.set(len(self._waiters))
