"""Admission control: a limit on sequences in flight and a bounded queue in front of it.

A request comes here once its whole body is in (``pd.server.routes.common``): a client that
trickles its body never holds a place. A request of ``n`` choices holds ``n`` places (its n
sequences decode as n rows), all taken at once and given back together.

1. A request arrives: enough free places and nobody waiting -> it is admitted at once
   (``AdmissionTicket``); more places than the server has -> 400.
2. Else it waits in the queue, ordered by priority then arrival (``pd.core.priority``: none is
   overtaken more than ``MAX_OVERTAKES`` times); a full queue -> 429 at once.
3. Finishing requests hand their places straight to the head of the queue, as soon as enough
   are free for it (no polling; nobody goes around the head, so a large ``n`` is not starved
   by small ones).
4. A waiter that leaves (its client disconnected: ``ServerState.admit`` watches) or reaches
   its deadline leaves the queue at once; if a place was handed to it in the same instant, it
   passes the place on.
5. ``wait_empty`` returns once no place is held and nobody waits (a graceful shutdown);
   ``close`` refuses every waiter and every later request (a shutdown past its grace).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pd.core.priority import insert_ranked
from pd.server.http.errors import APIError
from pd.server.metrics import ServerMetrics

RETRY_AFTER_S = 1


class AdmissionTicket:
    """One admitted request's places; ``release()`` gives them back (idempotent)."""

    def __init__(self, admission: Admission, num_places: int = 1) -> None:
        self._admission: Admission | None = admission
        self.num_places = num_places

    def release(self) -> None:
        admission, self._admission = self._admission, None
        if admission is not None:
            admission._release(self.num_places)


class _Waiter:
    """A request in the queue: True on ``fut`` when its places are handed to it, False when it
    is refused."""

    def __init__(self, priority: int, num_places: int) -> None:
        self.priority = priority
        self.num_places = num_places
        self.num_overtaken = 0
        self.fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()


class Admission:
    def __init__(self, max_inflight: int, max_queued: int, metrics: ServerMetrics) -> None:
        assert max_inflight >= 1 and max_queued >= 0, (max_inflight, max_queued)
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.metrics = metrics
        self.num_inflight = 0
        self._waiters: list[_Waiter] = []  # in the order they will be admitted
        self._refusal: Callable[[], APIError] | None = None  # set by close()
        self._empty = asyncio.Event()
        self._empty.set()

    @property
    def num_queued(self) -> int:
        return len(self._waiters)

    @property
    def is_empty(self) -> bool:
        return self.num_inflight == 0 and not self._waiters

    def try_admit(self, num_places: int = 1) -> AdmissionTicket | None:
        """``num_places`` now, or None when the request would have to wait."""
        self._check_places(num_places)
        if self.num_inflight + num_places <= self.max_inflight and not self._waiters:
            self.num_inflight += num_places
            self._update_gauges()
            return AdmissionTicket(self, num_places)
        return None

    def _check_places(self, num_places: int) -> None:
        if num_places > self.max_inflight:
            raise APIError(
                f"n={num_places} choices need {num_places} admission places at once; this "
                f"server has {self.max_inflight} (--max-inflight-requests)",
                param="n",
            )
        assert num_places >= 1, num_places

    async def admit(
        self, timeout_s: float, num_places: int = 1, priority: int = 0
    ) -> AdmissionTicket:
        """``num_places`` places, now or after waiting in line (by ``priority``, lower first);
        400 when the server has fewer, 429 when the line is full, 504 when ``timeout_s``
        passes first, ``close``'s refusal once closed."""
        if self._refusal is not None:
            raise self._refusal()
        if (ticket := self.try_admit(num_places)) is not None:
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
        waiter = _Waiter(priority, num_places)
        fut = waiter.fut
        insert_ranked(self._waiters, waiter)
        self._update_gauges()
        start = time.perf_counter()
        try:
            await asyncio.wait({fut}, timeout=max(timeout_s, 0.0))
        except BaseException:  # cancelled: the client left while waiting
            if not fut.done():
                self._leave(waiter)
            elif fut.result():
                self._release(num_places)  # places arrived as we were cancelled: pass them on
            raise
        if not fut.done():
            self._leave(waiter)
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
        return AdmissionTicket(self, num_places)

    def close(self, refusal: Callable[[], APIError]) -> None:
        """Refuse every waiter, and every later request, with ``refusal()``."""
        self._refusal = refusal
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.fut.done():
                waiter.fut.set_result(False)
        self._update_gauges()

    def _release(self, num_places: int) -> None:
        self.num_inflight -= num_places
        assert self.num_inflight >= 0, self.num_inflight
        self._hand_out()

    def _hand_out(self) -> None:
        """Places to the head of the queue while enough are free for it (the places move to
        the waiter: num_inflight counts them at once)."""
        while self._waiters:
            head = self._waiters[0]
            if head.fut.done():  # cancelled: it is leaving
                self._waiters.pop(0)
                continue
            if self.num_inflight + head.num_places > self.max_inflight:
                break
            self._waiters.pop(0)
            self.num_inflight += head.num_places
            head.fut.set_result(True)
        self._update_gauges()

    def _leave(self, waiter: _Waiter) -> None:
        waiter.fut.cancel()
        self._waiters.remove(waiter)
        self._hand_out()  # the head may have been what held the next ones back

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
