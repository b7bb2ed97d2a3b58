"""The coordinator's pulls: when the prefill node it picks lacks a prefix another node holds, it
names that holder if pulling is estimated faster than computing (``PullCosts``, measured), and
logs the choice either way. Plain Python: cache events and stats are fed in by hand."""

from __future__ import annotations

import pytest

from pd.core.messages import CacheEventMsg, NodeStatsMsg, PullDoneMsg
from pd.router.coordinator import Coordinator
from pd.router.policy import CoordinatorConfig
from pd.router.pulls import PullCosts

PREFIX = list(range(100, 1100))  # 1,000 tokens
PER_TOKEN = 30_720  # SmolLM2-135M's KV bytes per token at fp32 (30 layers x 2 x 3 x 64 x 4)


def _coordinator(**kw) -> Coordinator:
    coord = Coordinator(CoordinatorConfig(local_prefill_tokens=-1, **kw))
    for node in ("p0", "p1"):
        coord.nodes.add_prefill(node)
    coord.nodes.add_decode("d0", 1 << 20)
    return coord


def _insert(coord: Coordinator, node: str, tokens: list[int], namespace: str = "") -> None:
    seq = coord.index(node).next_seq
    coord.apply_event(
        CacheEventMsg(node_id=node, seq=seq, kind="inserted", namespace=namespace, tokens=tokens)
    )


def _stats(node: str, **kw) -> NodeStatsMsg:
    base = dict(
        node_id=node, role="prefill", num_waiting=0, num_running=0, num_transferring=0,
        num_slots=0, num_free_slots=0, num_cached_tokens=0, num_hit_tokens=0,
        num_miss_tokens=0, transfer_bytes=0, transfer_seconds=0.0, num_transfers=0,
        num_queued_tokens=0,
    )  # fmt: skip
    return NodeStatsMsg(**(base | kw))


def _measured(coord: Coordinator, tokens_per_s: float, bytes_per_s: float) -> None:
    coord.costs.update(
        [
            _stats("p0", num_prefill_tokens=int(tokens_per_s * 10), prefill_seconds=10.0),
            _stats("p1", transfer_bytes=int(bytes_per_s * 2), transfer_wire_seconds=2.0),
        ],
        PER_TOKEN,
    )


def test_no_pull_before_both_rates_are_measured() -> None:
    coord = _coordinator()
    _insert(coord, "d0", PREFIX)  # a conversation prefilled on its decode node
    route = coord.route("r", PREFIX + [7, 8, 9], 4)
    assert route.pull is None and not coord.pulls.decisions
    coord.costs.update([_stats("p0", num_prefill_tokens=1000, prefill_seconds=1.0)], PER_TOKEN)
    assert coord.costs.estimate(1000) is None  # no bytes moved yet


def test_a_prefix_held_on_the_decode_node_is_pulled_when_that_is_faster() -> None:
    coord = _coordinator()
    _measured(coord, tokens_per_s=1000, bytes_per_s=1e9)  # 1 s to compute, ~31 ms to pull
    _insert(coord, "d0", PREFIX)
    prompt = PREFIX + [7, 8, 9]
    route = coord.route("r", prompt, 4)
    assert route.prefill in ("p0", "p1") and route.pull is not None
    assert route.pull.holder == "d0" and route.pull.num_tokens == len(PREFIX)
    assert route.num_matched == len(PREFIX)
    assert coord.nodes.load(route.prefill) == len(prompt) - len(PREFIX)  # only the rest is computed
    assert route.pull.timeout_s == pytest.approx(2.0)  # 2x the compute estimate
    (d,) = coord.pulls.decisions
    assert (d.choice, d.holder, d.num_tokens) == ("pull", "d0", len(PREFIX))
    assert d.est_pull_s == pytest.approx(len(PREFIX) * PER_TOKEN / 1e9)
    assert d.est_compute_s == pytest.approx(1.0)
    coord.pulls.done(
        PullDoneMsg(node_id=route.prefill, request_id="r", holder="d0", num_tokens=1000,
                    num_pulled=1000, seconds=0.05)
    )  # fmt: skip
    assert d.pull_s == 0.05 and d.num_pulled == 1000 and coord.pulls.num_pulled_tokens == 1000
    coord.on_finished("r")
    coord.check_integrity()


def test_load_sends_a_warm_prompt_elsewhere_and_the_node_pulls_it() -> None:
    coord = _coordinator()
    _measured(coord, tokens_per_s=1000, bytes_per_s=1e9)
    assert coord.route("busy", list(range(5000, 15000)), 4).prefill == "p0"  # all idle: p0
    _insert(coord, "p0", PREFIX)  # p0 holds the prefix, and has 10,000 tokens to prefill
    route = coord.route("r", PREFIX + [1, 2], 4)
    assert route.prefill == "p1"  # the loads are unbalanced: the least loaded node
    assert route.pull is not None and route.pull.holder == "p0"
    assert route.pull.num_tokens == len(PREFIX)


def test_computing_is_chosen_when_measured_pulls_are_slower() -> None:
    coord = _coordinator()
    coord.costs.update(  # a fast model on a slow link, as pulls measured it
        [
            _stats("p0", num_prefill_tokens=10_000_000, prefill_seconds=10.0),
            _stats("p1", pull_bytes=2_000_000, pull_seconds=2.0),
        ],
        PER_TOKEN,
    )
    _insert(coord, "d0", PREFIX)
    route = coord.route("r", PREFIX + [7], 4)
    assert route.pull is None and route.num_matched == 0
    (d,) = coord.pulls.decisions
    assert d.choice == "compute" and d.est_pull_s > d.est_compute_s
    assert coord.pulls.num_computed == 1 and coord.pulls.num_pulls == 0


@pytest.mark.parametrize("case", ["off", "too_short", "other_namespace", "held_by_the_node"])
def test_no_pull(case: str) -> None:
    coord = _coordinator(pull_min_tokens=-1 if case == "off" else 64)
    _measured(coord, tokens_per_s=1000, bytes_per_s=1e9)
    prefix = PREFIX[:60] if case == "too_short" else PREFIX
    if case == "held_by_the_node":  # the node picked (cache-aware) holds it itself
        _insert(coord, "p1", PREFIX)
    _insert(coord, "d0", prefix, namespace="tenant-b" if case == "other_namespace" else "")
    route = coord.route("r", PREFIX + [7], 4, namespace="")
    assert route.pull is None
    assert not coord.pulls.decisions


def test_the_bytes_rate_of_pulls_wins_over_that_of_transfers() -> None:
    costs = PullCosts()
    costs.update(
        [
            _stats("p0", transfer_bytes=100, transfer_wire_seconds=1.0, num_prefill_tokens=5,
                   prefill_seconds=1.0),
            _stats("p1", pull_bytes=4000, pull_seconds=2.0),
        ],
        10,
    )  # fmt: skip
    assert costs.bytes_per_s == 2000 and costs.prefill_tokens_per_s == 5
    assert costs.estimate(100) == pytest.approx((0.5, 20.0))


def test_before_any_pull_is_measured_one_is_tried_whatever_the_transfers_say() -> None:
    coord = _coordinator()
    _measured(coord, tokens_per_s=1e6, bytes_per_s=1e6)  # transfers slow (e.g. waiting for room)
    _insert(coord, "d0", PREFIX)
    route = coord.route("r", PREFIX + [7], 4)
    assert route.pull is not None and route.pull.holder == "d0"
    (d,) = coord.pulls.decisions
    assert d.choice == "pull" and d.est_pull_s > d.est_compute_s
