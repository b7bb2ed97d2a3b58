"""``RouteLog``: where the coordinator sent each recent request, for an operator (and the chaos
soak) asking after one answer: ``GET /admin/routes?request_id=...``.

One record an attempt (a request's wire id: its id, then ``id~1``, ... after re-routes), the
last ``maxlen`` of them, oldest dropped first: 16,384 by default, a 30-minute soak's routed
requests (~6,000) with room, about 4 MiB."""

from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple, Protocol


class _Pull(Protocol):
    holder: str
    num_tokens: int


class _Route(Protocol):
    prefill: str | None
    decode: str
    num_matched: int
    pull: _Pull | None


class RouteRecord(NamedTuple):
    request_id: str  # the attempt's wire id
    at: float  # wall-clock seconds (time.time) when it was routed
    prefill: str | None  # None: prefilled on its decode node alone
    decode: str
    num_matched: int  # prompt tokens the node that prefills was expected to hold (or pull)
    pull_from: str | None  # the node it pulled its prefix from, if any
    num_pulled: int  # ... and how many tokens (0: no pull)


class RouteLog:
    def __init__(self, maxlen: int = 16384) -> None:
        self._records: deque[RouteRecord] = deque(maxlen=maxlen)

    def add(self, request_id: str, route: _Route) -> None:
        pull = route.pull
        self._records.append(
            RouteRecord(
                request_id,
                time.time(),
                route.prefill,
                route.decode,
                route.num_matched,
                pull.holder if pull is not None else None,
                pull.num_tokens if pull is not None else 0,
            )
        )

    def of(self, request_id: str) -> list[RouteRecord]:
        """Every attempt of ``request_id`` still in the log, oldest first."""
        retry = request_id + "~"
        return [
            r for r in self._records if r.request_id == request_id or r.request_id.startswith(retry)
        ]
