"""``LatencyWindow``: recent samples of one latency (TTFT or TPOT) as the cluster client sees
them, for the autoscaler's quantiles over a sliding window."""

from __future__ import annotations

import time
from collections import deque


class LatencyWindow:
    def __init__(self, max_age_s: float = 120.0, max_samples: int = 65536) -> None:
        self.max_age_s = max_age_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (when, seconds)

    def add(self, seconds: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._samples.append((now, seconds))
        while self._samples and self._samples[0][0] < now - self.max_age_s:
            self._samples.popleft()

    def quantile(self, q: float, since: float) -> float | None:
        """The ``q`` quantile (nearest rank) of the samples taken at ``since`` or later; None
        when there are none."""
        values = sorted(v for t, v in self._samples if t >= since)
        if not values:
            return None
        return values[min(len(values) - 1, int(q * len(values)))]
