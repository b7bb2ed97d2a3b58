"""The SLO autoscaler: each pool's size follows its latency target, one node at a time.

Every ``interval_s`` each pool is read as a few *signals*, each a value beside its target:

- prefill: ``ttft`` (p90 time to first token, waits for decode room left out: a full decode
  pool is the decode signals' to show, and growing the prefill pool would not help) against
  ``ttft_slo``,
  and ``queue`` (the prompt tokens queued per prefill node over the tokens/s a node prefills,
  i.e. the wait a new request would see) against ``ttft_slo``;
- decode: ``tpot`` (p90 time per output token) against ``tpot_slo``, and ``kv_usage`` (KV slots
  held by requests, cached prefixes not counted) against ``kv_usage_target``.

The pool's *pressure* is its highest value/target ratio, and ``decide`` (a pure function of the
signals, the pool's ``PoolState`` and the clock) turns it into a size (Dynamo planner's load
rule, with its fixes):

0. A size an operator set outside the pool's range (``/admin/scale``, ``pd scale``, a drain)
   is the operator's: the autoscaler holds it until the operator sets another, or the pool's
   size comes back within range. One set within range is a starting point: the rule goes on
   from it, its cooldown counted from the operator's change. (A size outside the range given
   at start-up, ``pd serve --prefill``, is brought inside at once.)
1. No decision while a node of the pool starts or drains (latencies count only from the moment
   the pool settled, so a scale is judged by what it did).
2. **+1** after ``up_breaches`` consecutive decisions with pressure > 1, up to the pool's max.
3. **−1** when the pool would still be under ``down_margin`` of its targets with one node less
   (pressure · N/(N−1) < 0.8: it will not come straight back) for ``cooldown_s`` without a
   break, and ``cooldown_s`` after its last change, down to its min. No traffic at all
   counts as below (no latency samples, an empty queue).

Each change is logged with its reason and counted in ``pd_autoscaler_decisions_total{pool,
reason}``; ``pd_autoscaler_desired{pool}`` is the size it wants. pd decides how many nodes;
Ray (and its autoscaler, which adds a machine when a node's actor asks for a GPU that no machine
has) decides where.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge

from pd.cluster.client_config import ROLES
from pd.core.options import option

if TYPE_CHECKING:
    from pd.fleet.launcher import Cluster

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutoscalerConfig:
    """``pd serve`` flags: ``--autoscale``, ``--autoscale-*``, ``--ttft-slo``, ``--tpot-slo``."""

    enabled: bool = option(
        False, "resize the pools to meet --ttft-slo and --tpot-slo", flag="autoscale"
    )
    min_prefill: int = option(1, "the prefill pool's smallest size")
    max_prefill: int = option(4, "the prefill pool's largest size")
    min_decode: int = option(1, "the decode pool's smallest size")
    max_decode: int = option(4, "the decode pool's largest size")
    ttft_slo: float = option(2.0, "target p90 time to first token (s)", flag="ttft_slo")
    tpot_slo: float = option(0.2, "target p90 time per output token (s)", flag="tpot_slo")
    kv_usage_target: float = option(0.85, "target share of a decode node's KV slots in use")
    cooldown_s: float = option(
        60.0, "a pool shrinks after this long below target and this long after its last change"
    )
    up_breaches: int = option(2, "consecutive decisions above target before a pool grows")
    interval_s: float = option(1.0, "seconds between decisions")
    window_s: float = option(30.0, "latency quantiles are taken over this many seconds")
    down_margin: float = option(
        0.8, "a pool shrinks only if one node less keeps it under this share of its targets"
    )

    def __post_init__(self) -> None:
        for role in ROLES:
            lo, hi = self.limits(role)
            if not 1 <= lo <= hi:
                raise ValueError(f"need 1 <= min_{role} <= max_{role}, got {lo} and {hi}")
        for name in ("ttft_slo", "tpot_slo", "kv_usage_target", "interval_s", "window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.cooldown_s < 0 or self.up_breaches < 1 or not 0 < self.down_margin < 1:
            raise ValueError(
                f"need cooldown_s >= 0 ({self.cooldown_s}), up_breaches >= 1 "
                f"({self.up_breaches}), 0 < down_margin < 1 ({self.down_margin})"
            )

    def limits(self, role: str) -> tuple[int, int]:
        return (self.min_prefill, self.max_prefill) if role == "prefill" else (
            self.min_decode, self.max_decode,
        )  # fmt: skip


class Signal(NamedTuple):
    name: str  # "ttft" | "queue" | "tpot" | "kv_usage"
    value: float | None  # None: no samples yet
    target: float


class Decision(NamedTuple):
    desired: int
    reason: str  # why it changes (or "hold: ..." why not)


@dataclass
class PoolState:
    """What ``decide`` remembers of a pool between decisions."""

    num_breaches: int = 0  # consecutive decisions above target
    calm_since: float | None = None  # below the shrink threshold without a break since then
    last_change: float = -math.inf


def pressure(signals: Sequence[Signal]) -> tuple[float, str]:
    """The highest value/target ratio and its signal's name; (0, "idle") when nothing has
    a value or everything is zero."""
    worst, name = 0.0, "idle"
    for s in signals:
        if s.value is not None and s.value / s.target > worst:
            worst, name = s.value / s.target, s.name
    return worst, name


def decide(
    cfg: AutoscalerConfig,
    role: str,
    size: int,
    is_pending: bool,
    signals: Sequence[Signal],
    state: PoolState,
    now: float,
) -> Decision:
    """The size ``role``'s pool should have (module docstring); updates ``state``."""
    lo, hi = cfg.limits(role)
    if is_pending:
        state.num_breaches, state.calm_since = 0, None
        return Decision(size, "hold: a node is starting or draining")
    if not lo <= size <= hi:
        return _change(
            state, now, min(max(size, lo), hi), "below_min" if size < lo else "above_max"
        )
    ratio, name = pressure(signals)
    if ratio > 1.0:
        state.calm_since = None
        state.num_breaches += 1
        if state.num_breaches < cfg.up_breaches:
            return Decision(size, f"hold: {name} above target ({state.num_breaches} time(s))")
        if size >= hi:
            return Decision(size, f"hold: {name} above target at the max ({hi})")
        return _change(state, now, size + 1, f"{name}_above_target")
    state.num_breaches = 0
    if size > lo and ratio * size / (size - 1) < cfg.down_margin:
        state.calm_since = now if state.calm_since is None else state.calm_since
        since = min(now - state.calm_since, now - state.last_change)
        if since >= cfg.cooldown_s:
            return _change(state, now, size - 1, "idle" if ratio == 0 else f"{name}_below_target")
        return Decision(size, f"hold: below target for {since:.1f} s of {cfg.cooldown_s} s")
    state.calm_since = None
    return Decision(size, "hold: within target")


def _change(state: PoolState, now: float, size: int, reason: str) -> Decision:
    state.num_breaches, state.calm_since, state.last_change = 0, None, now
    return Decision(size, reason)


class _Rate:
    """A prefill node's tokens/s while it had work queued (EWMA of stats deltas)."""

    def __init__(self) -> None:
        self.tokens_per_s: float | None = None
        self._last: tuple[float, int, bool] | None = None  # (when, tokens admitted, was busy)

    def update(self, now: float, num_tokens: int, is_busy: bool) -> None:
        if self._last is not None and self._last[2] and now > self._last[0]:
            rate = (num_tokens - self._last[1]) / (now - self._last[0])
            old = self.tokens_per_s
            self.tokens_per_s = rate if old is None else 0.7 * old + 0.3 * rate
        self._last = (now, num_tokens, is_busy)


class Autoscaler:
    """Reads the cluster, ``decide``s for each pool and scales it (on the client's loop)."""

    def __init__(
        self,
        cfg: AutoscalerConfig,
        cluster: Cluster,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.cluster = cluster
        self.clock = clock
        self.states = {role: PoolState() for role in ROLES}
        self.last: dict[str, Decision] = {}
        self._settled = dict.fromkeys(ROLES, -math.inf)  # when each pool last stopped changing
        self._is_operators = dict.fromkeys(ROLES, False)  # its size is an operator's, outside range
        self._rates: dict[str, _Rate] = {}
        registry = registry or CollectorRegistry()
        self.desired = Gauge(
            "pd_autoscaler_desired", "Pool size the autoscaler wants.", ["pool"], registry=registry
        )
        self.decisions = Counter(
            "pd_autoscaler_decisions", "Pool size changes by the autoscaler, by reason.",
            ["pool", "reason"], registry=registry,
        )  # fmt: skip

    async def run(self) -> None:
        while True:
            try:
                self.step()
            except Exception:  # a bad reading must not end autoscaling
                logger.exception("autoscaler step failed")
            await asyncio.sleep(self.cfg.interval_s)

    def set_by_operator(self, role: str, size: int) -> None:
        """An operator set ``role``'s pool to ``size`` (rule 0 of the module docstring)."""
        lo, hi = self.cfg.limits(role)
        self._is_operators[role] = not lo <= size <= hi
        _change(self.states[role], self.clock(), size, "operator")

    def step(self) -> dict[str, Decision]:
        now = self.clock()
        for role in ROLES:
            size = self.cluster.target[role]
            is_pending = self.cluster.is_pending(role)
            if is_pending:
                self._settled[role] = now
            signals = self.signals(role, now)
            lo, hi = self.cfg.limits(role)
            self._is_operators[role] &= not lo <= size <= hi
            if self._is_operators[role]:
                d = self.last[role] = Decision(
                    size, f"hold: the operator's size, outside {lo}..{hi}"
                )
            else:
                d = self.last[role] = decide(
                    self.cfg, role, size, is_pending, signals, self.states[role], now
                )
            self.desired.labels(pool=role).set(d.desired)
            if d.desired != size:
                readings = ", ".join(f"{s.name} {s.value} (target {s.target})" for s in signals)
                logger.warning(
                    "autoscaler: %s %d -> %d: %s; %s", role, size, d.desired, d.reason, readings
                )
                self.decisions.labels(pool=role, reason=d.reason).inc()
                self.cluster.scale(**{role: d.desired})
        return dict(self.last)

    def signals(self, role: str, now: float) -> list[Signal]:
        client, cfg = self.cluster.client, self.cfg
        since = max(now - cfg.window_s, self._settled[role])
        latest = client.membership.node_stats
        stats = [latest[n] for n in self.cluster.nodes_of(role) if n in latest]
        if role == "prefill":
            return [
                Signal("ttft", client.ttft.quantile(0.9, since), cfg.ttft_slo),
                Signal("queue", self._queue_wait(stats, now), cfg.ttft_slo),
            ]
        usage = [
            (s.num_slots - s.num_free_slots - s.num_cached_tokens) / s.num_slots for s in stats
        ]
        return [
            Signal("tpot", client.tpot.quantile(0.9, since), cfg.tpot_slo),
            Signal("kv_usage", sum(usage) / len(usage) if usage else None, cfg.kv_usage_target),
        ]

    def _queue_wait(self, stats: list[Any], now: float) -> float | None:
        """Seconds the prompt tokens queued per prefill node take at a node's observed rate."""
        for s in stats:
            rate = self._rates.setdefault(s.node_id, _Rate())
            rate.update(now, s.num_hit_tokens + s.num_miss_tokens, s.num_queued_tokens > 0)
        queued = sum(s.num_queued_tokens for s in stats)
        if not stats or queued == 0:
            return 0.0
        rates = [r for s in stats if (r := self._rates[s.node_id].tokens_per_s)]
        return queued / len(stats) / (sum(rates) / len(rates)) if rates else None
