"""The autoscaler's rule as a pure function on a fake clock (``decide``), then its loop over a
fake cluster (``Autoscaler.step``): what it reads, what it asks for, what /metrics shows."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pd.cluster.slo import LatencyWindow
from pd.core.messages import NodeStatsMsg
from pd.fleet.autoscaler import (
    Autoscaler,
    AutoscalerConfig,
    PoolState,
    Signal,
    decide,
    pressure,
)
from tests.conftest import make_node_stats

pytestmark = pytest.mark.timeout(30)
CFG = AutoscalerConfig(
    enabled=True, min_prefill=1, max_prefill=3, ttft_slo=1.0, cooldown_s=10.0, up_breaches=2
)


def _ttft(value: float | None) -> list[Signal]:
    return [Signal("ttft", value, 1.0), Signal("queue", 0.0, 1.0)]


def _run(
    sizes: Sequence[float | None], size: int = 1, start: float = 0.0, step: float = 1.0
) -> tuple[list[int], list[str], PoolState]:
    """Decisions for a series of p90 TTFTs, one a second, the pool taking each new size."""
    state, desired, reasons = PoolState(), [], []
    for i, ttft in enumerate(sizes):
        d = decide(CFG, "prefill", size, False, _ttft(ttft), state, start + i * step)
        size = d.desired
        desired.append(size)
        reasons.append(d.reason)
    return desired, reasons, state


def test_a_pool_grows_by_one_after_two_consecutive_breaches_up_to_its_max() -> None:
    desired, reasons, _ = _run([2.0, 2.0, 2.0, 2.0, 2.0, 2.0])
    assert desired == [1, 2, 2, 3, 3, 3]
    assert reasons[1] == reasons[3] == "ttft_above_target"
    assert reasons[5].startswith("hold") and "max" in reasons[5]


def test_one_breach_between_good_readings_is_not_enough() -> None:
    desired, _, _ = _run([2.0, 0.9, 2.0, 0.9, 2.0])
    assert desired == [1] * 5


def test_no_decision_while_a_scale_is_pending_and_breaches_count_again_after() -> None:
    state = PoolState()
    assert decide(CFG, "prefill", 1, False, _ttft(2.0), state, 0).desired == 1
    for t in (1, 2, 3):  # a node starts: breaches do not pile up meanwhile
        d = decide(CFG, "prefill", 1, True, _ttft(5.0), state, t)
        assert d.desired == 1 and d.reason.startswith("hold")
    assert decide(CFG, "prefill", 1, False, _ttft(2.0), state, 4).desired == 1
    assert decide(CFG, "prefill", 1, False, _ttft(2.0), state, 5).desired == 2


def test_zero_traffic_counts_as_below_and_the_pool_shrinks_after_the_cooldown() -> None:
    state, size, sizes = PoolState(last_change=0.0), 3, []
    for t in range(32):
        d = decide(CFG, "prefill", size, False, _ttft(None), state, t)
        size = d.desired
        sizes.append(size)
        assert d.reason in ("idle", "hold: within target") or d.reason.startswith("hold: below")
    # below from t=0; one node less at t=10, the next a cooldown later, then it stays at its min
    assert sizes == [3] * 10 + [2] * 11 + [1] * 11
    assert pressure(_ttft(None)) == (0.0, "idle")


def test_a_reading_above_target_restarts_the_cooldown() -> None:
    state = PoolState()
    for t in range(8):
        assert decide(CFG, "prefill", 2, False, _ttft(0.1), state, t).desired == 2
    assert decide(CFG, "prefill", 2, False, _ttft(1.5), state, 8).desired == 2  # one breach
    for t in range(9, 18):
        assert decide(CFG, "prefill", 2, False, _ttft(0.1), state, t).desired == 2
    assert decide(CFG, "prefill", 2, False, _ttft(0.1), state, 19).desired == 1


def test_consolidation_aware_scale_down_does_not_oscillate_between_two_and_one() -> None:
    """At 0.5 of target on 2 nodes, 1 node would run at 1.0: above 0.8, so it stays at 2 (a
    plain "below target" rule would go to 1, breach, come back to 2, ...)."""
    state = PoolState()
    sizes = {decide(CFG, "prefill", 2, False, _ttft(0.5), state, t).desired for t in range(60)}
    assert sizes == {2}
    state = PoolState()
    sizes = [decide(CFG, "prefill", 2, False, _ttft(0.3), state, t).desired for t in range(11)]
    assert sizes[-1] == 1  # 0.3 * 2 / 1 = 0.6 < 0.8


def test_sizes_outside_the_limits_are_brought_inside() -> None:
    state = PoolState()
    assert decide(CFG, "prefill", 5, False, _ttft(9.0), state, 0) == (3, "above_max")
    cfg = dataclasses.replace(CFG, min_prefill=2)
    assert decide(cfg, "prefill", 1, False, _ttft(None), state, 0) == (2, "below_min")


def test_the_worst_signal_decides_and_names_the_reason() -> None:
    signals = [
        Signal("tpot", 0.05, 0.1),
        Signal("kv_usage", 0.95, 0.85),
        Signal("ttft", None, 1.0),
    ]
    ratio, name = pressure(signals)
    assert name == "kv_usage" and ratio == pytest.approx(0.95 / 0.85)


@pytest.mark.parametrize(
    "bad",
    [
        {"min_prefill": 0},
        {"min_decode": 3, "max_decode": 2},
        {"ttft_slo": 0.0},
        {"up_breaches": 0},
        {"down_margin": 1.0},
    ],
)
def test_bad_settings_are_refused_with_their_numbers(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=str(next(iter(bad.values())))):
        AutoscalerConfig(**bad)  # type: ignore[arg-type]


# -- the loop over a fake cluster -------------------------------------------------------------


class _Membership:
    def __init__(self) -> None:
        self.node_stats: dict[str, NodeStatsMsg] = {}


class _Client:
    def __init__(self) -> None:
        self.ttft, self.tpot = LatencyWindow(), LatencyWindow()
        self.membership = _Membership()


class _Cluster:
    def __init__(self) -> None:
        self.client = _Client()
        self.target = {"prefill": 1, "decode": 1}
        self.pending: set[str] = set()
        self.scaled: list[dict[str, int]] = []

    def nodes_of(self, role: str) -> list[str]:
        return [n for n, s in self.client.membership.node_stats.items() if s.role == role]

    def is_pending(self, role: str) -> bool:
        return role in self.pending

    def scale(self, **targets: int) -> None:
        self.scaled.append(targets)
        self.target.update(targets)


def _stats(node_id: str, queued: int = 0, admitted: int = 0, in_use: int = 0) -> NodeStatsMsg:
    role = node_id.split("-")[0]
    free = 1000 - in_use
    return make_node_stats(
        node_id,
        role,
        num_slots=1000,
        num_free_slots=free,
        num_hit_tokens=admitted,
        num_queued_tokens=queued,
    )


def test_the_loop_scales_on_latency_and_queue_and_exports_its_decisions() -> None:
    cluster, clock = _Cluster(), [100.0]
    registry = CollectorRegistry()
    cfg = dataclasses.replace(CFG, tpot_slo=0.1, kv_usage_target=0.5)
    auto = Autoscaler(cfg, cluster, registry, clock=lambda: clock[0])  # type: ignore[arg-type]
    client = cluster.client
    client.membership.node_stats = {
        "prefill-0": _stats("prefill-0"),
        "decode-0": _stats("decode-0"),
    }

    def tick(seconds: float = 1.0) -> dict[str, str]:
        clock[0] += seconds
        return {pool: d.reason for pool, d in auto.step().items()}

    # 1. slow first tokens: two breaches, then +1 prefill; decode is fine
    for _ in range(2):
        client.ttft.add(3.0, clock[0])
        reasons = tick()
    assert cluster.scaled == [{"prefill": 2}] and reasons["prefill"] == "ttft_above_target"
    assert reasons["decode"] == "hold: within target"
    # 2. while the new node starts, nothing; once it is up, the old slow samples do not count
    cluster.pending.add("prefill")
    client.ttft.add(3.0, clock[0])
    assert tick()["prefill"].startswith("hold: a node")
    cluster.pending.clear()
    assert tick()["prefill"].startswith("hold: below target")  # not a breach
    # 3. a queue the prefill nodes need 4 s to work through (they do 100 tokens/s) is a breach
    client.membership.node_stats["prefill-1"] = _stats("prefill-1")
    for admitted in (0, 100, 200):
        for n in ("prefill-0", "prefill-1"):
            client.membership.node_stats[n] = _stats(n, queued=400, admitted=admitted)
        reasons = tick()
    assert cluster.scaled[-1] == {"prefill": 3} and reasons["prefill"] == "queue_above_target"
    # 4. decode KV usage over its target: +1 decode
    client.membership.node_stats["decode-0"] = _stats("decode-0", in_use=800)
    tick()
    tick()
    assert cluster.scaled[-1] == {"decode": 2}
    text = generate_latest(registry).decode()
    assert 'pd_autoscaler_desired{pool="prefill"} 3.0' in text
    assert 'pd_autoscaler_desired{pool="decode"} 2.0' in text
    assert 'pd_autoscaler_decisions_total{pool="prefill",reason="ttft_above_target"} 1.0' in text
    assert 'pd_autoscaler_decisions_total{pool="prefill",reason="queue_above_target"} 1.0' in text
    assert 'pd_autoscaler_decisions_total{pool="decode",reason="kv_usage_above_target"} 1.0' in text
    # 5. then nothing at all: each pool goes back to 1, one node per cooldown
    for n in list(client.membership.node_stats):
        client.membership.node_stats[n] = _stats(n)
    for _ in range(40):
        tick()
    assert cluster.target == {"prefill": 1, "decode": 1}
    assert [s for s in cluster.scaled[-3:]] == [{"prefill": 2}, {"decode": 1}, {"prefill": 1}]


def test_an_operators_size_outside_the_range_is_kept_until_the_operator_changes_it() -> None:
    """Through ClusterAdmin, as /admin/scale and a drain call it: a size above the max (or below
    the min) is the operator's, held however idle the pool; one within the range is where the
    rule goes on from, its cooldown counted from the operator's change."""
    from pd.fleet.admin import ClusterAdmin

    cluster, clock = _Cluster(), [100.0]
    auto = Autoscaler(CFG, cluster, clock=lambda: clock[0])  # type: ignore[arg-type]
    admin = ClusterAdmin(cluster)  # type: ignore[arg-type]
    admin.autoscaler = auto

    def ticks(n: int) -> list[str]:
        reasons = []
        for _ in range(n):
            clock[0] += 1.0
            reasons.append(auto.step()["prefill"].reason)
        return reasons

    admin.scale(prefill=6)  # max_prefill is 3; no traffic at all
    assert set(ticks(30)) == {"hold: the operator's size, outside 1..3"}
    assert cluster.target["prefill"] == 6 and cluster.scaled == [{"prefill": 6}]
    cluster.client.ttft.add(9.0, clock[0])  # nor does a breach move it
    assert set(ticks(int(CFG.window_s) + 1)) == {"hold: the operator's size, outside 1..3"}
    admin.scale(prefill=3)  # back within range: the rule goes on from 3, after a cooldown
    reasons = ticks(int(CFG.cooldown_s) + 1)
    assert cluster.scaled[-1] == {"prefill": 2} and reasons[-1] == "idle"
    assert all(r.startswith("hold: below target") for r in reasons[:-1])
    # a size outside the range that no operator set (pd serve --prefill 5) is brought inside
    cluster.target["prefill"] = 5
    assert ticks(1) == ["above_max"] and cluster.target["prefill"] == 3
