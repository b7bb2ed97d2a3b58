"""Coordinator: routing decisions, bookkeeping, and a cluster simulation over real RadixCaches.

The simulation drives each simulated prefill node the way ``prefill/`` does (match the prompt,
lock, make room, extend, ``cache_finished``) and feeds the node's cache events back to the
coordinator, optionally ``delay`` requests late to mimic prefills still in flight.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Sequence
from typing import NamedTuple

import pytest

from pd.cache import NoPrefixCache
from pd.core.kv_pool import SlotAllocator
from pd.core.messages import CacheEventMsg
from pd.core.request import Req
from pd.core.sampling_params import SamplingParams
from pd.engine.slots import SlotBudget
from pd.router.coordinator import Coordinator, Route
from pd.router.policy import CoordinatorConfig, NoCapacityError
from pdtools.routing_model import SimPrefill

# Thresholds used throughout, spelled out so a change of CoordinatorConfig defaults shows up here.
BALANCE_ABS_TOKENS = 4096
BALANCE_REL = 2.0
CACHE_THRESHOLD = 0.25

NUM_GROUPS = 8
PROMPTS_PER_GROUP = 16
PREFIX_LEN = 1024
SUFFIX_LEN = (32, 128)
MAX_TOKENS = 16
# A node holds about half the groups' prefixes (4.5 x 1024 tokens): with cache-aware routing
# each node keeps its own groups' prefixes; round robin makes every node cycle through all 8.
NODE_SLOTS = 4608
# Requests cache_aware may send off their group's node: when the LRU has trimmed a group's
# prefix on its node below CACHE_THRESHOLD of the prompt, the next request of that group goes
# to the least-loaded node (1 such request with this workload; the load-balance rule itself
# never fires here, as loads stay below BALANCE_ABS_TOKENS with <= 4 prefills in flight).
MAX_STRAYS = 2


def _make_config(policy: str = "cache_aware", **kw: float) -> CoordinatorConfig:
    args: dict = dict(
        policy=policy,
        balance_abs_tokens=BALANCE_ABS_TOKENS,
        balance_rel=BALANCE_REL,
        cache_threshold=CACHE_THRESHOLD,
        local_prefill_tokens=-1,  # the prefill side's rules; conditional disaggregation below
    )
    args.update(kw)
    return CoordinatorConfig(**args)


def _make_coordinator(
    num_prefill: int = 2, decode_slots: Sequence[int] = (1 << 20,), **kw: float
) -> Coordinator:
    coord = Coordinator(_make_config(**kw))
    for i in range(num_prefill):
        coord.nodes.add_prefill(f"p{i}")
    for i, num_slots in enumerate(decode_slots):
        coord.nodes.add_decode(f"d{i}", num_slots)
    return coord


def _insert(coord: Coordinator, node_id: str, tokens: list[int], namespace: str = "") -> None:
    """Tell the coordinator that ``node_id``'s cache now holds ``tokens``."""
    seq = coord.index(node_id).next_seq
    coord.apply_event(
        CacheEventMsg(node_id=node_id, seq=seq, kind="inserted", namespace=namespace, tokens=tokens)
    )


def _tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# -- the simulation ----------------------------------------------------------------------------


class SimResult(NamedTuple):
    hit_rate: float  # cluster-wide matched tokens / prompt tokens, counted by the caches
    group_nodes: dict[int, Counter[str]]  # group -> prefill node -> requests
    num_evicted: int  # tokens evicted, all nodes


def _make_workload(seed: int = 0) -> list[tuple[int, list[int]]]:
    """NUM_GROUPS x PROMPTS_PER_GROUP prompts: a group prefix + a random suffix, interleaved."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 50_000) for _ in range(PREFIX_LEN)] for _ in range(NUM_GROUPS)]
    work = [
        (g, prefixes[g] + [rng.randrange(1, 50_000) for _ in range(rng.randint(*SUFFIX_LEN))])
        for g in range(NUM_GROUPS)
        for _ in range(PROMPTS_PER_GROUP)
    ]
    rng.shuffle(work)
    return work


def _simulate(
    policy: str, num_prefill: int, delay: int, num_decode: int = 2, node_slots: int = NODE_SLOTS
) -> SimResult:
    """Route the workload. Each node prefills a request as it is routed (so its cache is always
    current), but the coordinator hears of it (cache events, then the first token) only
    ``delay`` requests later, as if the prefill were still running; the decode finishes
    ``delay`` requests after that."""
    coord = _make_coordinator(num_prefill, decode_slots=[64 * 1024] * num_decode, policy=policy)
    nodes = {n: SimPrefill(n, node_slots, page_size=1) for n in coord.nodes.prefill_nodes}
    in_prefill: deque[tuple[str, list[CacheEventMsg]]] = deque()
    in_decode: deque[str] = deque()
    group_nodes: dict[int, Counter[str]] = {g: Counter() for g in range(NUM_GROUPS)}

    def deliver(max_in_flight: int) -> None:
        while len(in_prefill) > max_in_flight:
            rid, events = in_prefill.popleft()
            for event in events:
                coord.apply_event(event)
            coord.on_prefilled(rid)
            in_decode.append(rid)
        while len(in_decode) > max_in_flight:
            coord.on_finished(in_decode.popleft())

    for i, (group, prompt) in enumerate(_make_workload()):
        rid = f"r{i}"
        route = coord.route(rid, prompt, MAX_TOKENS)
        group_nodes[group][route.prefill] += 1
        in_prefill.append((rid, nodes[route.prefill].prefill(prompt)))
        deliver(delay)
        if i % 16 == 0:
            coord.check_integrity()
    deliver(0)
    coord.check_integrity()

    for node_id, sim in nodes.items():
        sim.cache.check_integrity()
        sim.cache.check_slot_ownership([])
        index = coord.index(node_id)
        assert not index.needs_resync and index.next_seq == sim.cache.events.next_seq
        assert index.num_cached_tokens == sim.cache.num_cached_tokens
        assert sim.num_hit_tokens == sim.cache.stats.num_hit_tokens
        assert coord.nodes.load(node_id) == 0
    hits = sum(s.num_hit_tokens for s in nodes.values())
    total = sum(s.num_prompt_tokens for s in nodes.values())
    evicted = sum(s.cache.stats.num_evicted_tokens for s in nodes.values())
    return SimResult(hits / total, group_nodes, evicted)


def _num_strays(group_nodes: dict[int, Counter[str]]) -> int:
    """Requests not routed to their group's main prefill node."""
    return sum(sum(c.values()) - max(c.values()) for c in group_nodes.values())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_prefill", [2, 3])
@pytest.mark.parametrize("delay", [0, 3])
def test_cache_aware_pins_groups_and_beats_round_robin(num_prefill: int, delay: int) -> None:
    aware = _simulate("cache_aware", num_prefill, delay)
    rr = _simulate("round_robin", num_prefill, delay)
    strays = _num_strays(aware.group_nodes)
    print(
        f"\n{num_prefill} prefill nodes, events {delay} requests late: prefix hit rate"
        f" cache_aware {aware.hit_rate:.3f}, round_robin {rr.hit_rate:.3f}"
        f" ({aware.hit_rate / rr.hit_rate:.2f}x); evicted tokens {aware.num_evicted} vs"
        f" {rr.num_evicted}; cache_aware strays {strays}"
    )
    assert strays <= MAX_STRAYS, {g: dict(c) for g, c in aware.group_nodes.items()}
    used = {n for c in aware.group_nodes.values() for n in c}
    assert len(used) == num_prefill, f"groups use only {sorted(used)}"
    assert rr.num_evicted > 0, "capacity too large: round robin never evicted"
    assert aware.hit_rate >= 1.8 * rr.hit_rate


# -- prefill choice ----------------------------------------------------------------------------

A = _tokens(1000, 200)  # a prefix cached on p0
B = _tokens(2000, 200)  # a prefix cached on p1


def _make_cached_pair(**kw: float) -> Coordinator:
    """p0 holds A, p1 holds B (small balance thresholds so tests can unbalance them)."""
    coord = _make_coordinator(2, **{"balance_abs_tokens": 100, **kw})
    _insert(coord, "p0", A)
    _insert(coord, "p1", B)
    return coord


def _suffix(tag: int, n: int) -> list[int]:
    return _tokens(100_000 * tag, n)


def test_unbalanced_loads_go_where_the_prompt_is_soonest_through_not_the_least_loaded() -> None:
    """Three nodes: p0 overloaded, p1 and p2 as busy, only p2 (and p0) holding the prefix.
    Past the thresholds the request goes to p2 (50 queued + 10 to compute), not p1 (50 + 210),
    which the least-loaded rule picked (it holds fewer tokens)."""
    coord = _make_coordinator(3, balance_abs_tokens=100)
    _insert(coord, "p0", A)
    coord.route("heavy", A + _suffix(1, 400), 8)  # p0, the holder
    coord.route("x1", _suffix(2, 50), 8)  # unbalanced: p1 (a tie with p2, registered first)
    coord.route("x2", _suffix(3, 50), 8)  # p2, now the soonest
    assert (coord.nodes.load("p0"), coord.nodes.load("p1"), coord.nodes.load("p2")) == (400, 50, 50)
    _insert(coord, "p2", A)
    assert coord.route("r", A + _suffix(4, 10), 8) == Route("p2", "d0", 200)
    # with nothing of the prompt held anywhere: the least loaded (p1, 50 vs p2's 60)
    assert coord.route("cold", _suffix(5, 300), 8).prefill == "p1"
    for rid in ("heavy", "x1", "x2", "r", "cold"):
        coord.on_finished(rid)
    coord.check_integrity()


@pytest.mark.timeout(10)
def test_unbalanced_loads_leave_the_holder_only_past_both_thresholds_and_when_sooner() -> None:
    # Only the relative threshold exceeded: p0 60 vs p1 0 tokens (60 <= 100 apart).
    coord = _make_cached_pair()
    assert coord.route("a", A + _suffix(1, 60), 8) == Route("p0", "d0", 200)
    assert (coord.nodes.load("p0"), coord.nodes.load("p1")) == (60, 0)
    assert coord.route("b", A + _suffix(2, 10), 8).prefill == "p0"

    # Only the absolute one: p0 300 vs p1 180 (120 > 100 apart, but 300 <= 2 x 180).
    coord = _make_cached_pair()
    coord.route("b0", B + _suffix(1, 180), 8)
    coord.route("a0", A + _suffix(2, 150), 8)
    coord.route("a1", A + _suffix(3, 150), 8)
    assert (coord.nodes.load("p0"), coord.nodes.load("p1")) == (300, 180)
    assert coord.route("a2", A + _suffix(4, 10), 8).prefill == "p0"

    # Both, and p0's queue is longer than what p1 would compute: p0 400 vs p1 0. A's follower
    # (210 tokens, A's 200 held by p0 only) would get through 400 + 10 there, 0 + 210 on p1.
    coord = _make_cached_pair()
    coord.route("a0", A + _suffix(1, 400), 8)
    assert coord.route("a1", A + _suffix(2, 10), 8) == Route("p1", "d0", 0)
    assert coord.nodes.load("p1") == 210
    # Once p0's prefill is done, A sticks to p0 again (its cache events arrived long ago).
    coord.on_prefilled("a0")
    assert coord.route("a2", A + _suffix(3, 10), 8) == Route("p0", "d0", 200)

    # Both, but the holder is still sooner: p0 150 vs p1 0; the follower computes 10 tokens
    # behind 150 on p0, 210 on p1. Loads are weighed against the missing prefix: p0.
    coord = _make_cached_pair()
    coord.route("a0", A + _suffix(1, 150), 8)
    assert coord.route("a1", A + _suffix(2, 10), 8) == Route("p0", "d0", 200)


@pytest.mark.timeout(10)
def test_below_cache_threshold_goes_to_least_loaded() -> None:
    coord = _make_cached_pair(cache_threshold=0.5)
    coord.route("a0", A + _suffix(1, 80), 8)  # 200 of 280 matched: p0, load 80
    assert coord.nodes.load("p0") == 80
    # 50 of 200 tokens held by p0 (0.25 < 0.5): least loaded, p1.
    assert coord.route("x", A[:50] + _suffix(2, 150), 8) == Route("p1", "d0", 0)
    # 50 of 90 (0.56 >= 0.5): p0 although it is the more loaded node.
    assert coord.route("y", A[:50] + _suffix(3, 40), 8) == Route("p0", "d0", 50)


@pytest.mark.timeout(10)
def test_longest_match_wins_and_ties_go_to_less_loaded() -> None:
    coord = _make_coordinator(3)
    _insert(coord, "p0", A[:100])
    _insert(coord, "p1", A)
    _insert(coord, "p2", A)
    coord.route("b", B, 8)  # cold: least loaded and fewest cached tokens, p0 (100 tokens)
    assert coord.nodes.load("p0") == 200
    coord.route("x", A + _suffix(1, 50), 8)  # p1 and p2 tie on 200 tokens: lower load, p1
    assert (coord.nodes.load("p1"), coord.nodes.load("p2")) == (50, 0)
    assert coord.route("y", A + _suffix(2, 50), 8) == Route("p2", "d0", 200)


@pytest.mark.timeout(10)
def test_idle_cluster_spreads_new_prefixes_by_cached_tokens() -> None:
    coord = _make_coordinator(3)
    _insert(coord, "p0", A)
    _insert(coord, "p1", B[:50])
    # No load anywhere: the node caching the fewest tokens takes a new prefix.
    assert coord.route("c", _suffix(1, 300), 8).prefill == "p2"


@pytest.mark.timeout(10)
def test_in_flight_prompt_makes_follower_stick_before_cache_events() -> None:
    coord = _make_coordinator(2)
    shared = _tokens(5000, 300)
    first = coord.route("r0", shared + _suffix(1, 40), 8)
    # The leader's node now has 340 tokens of load; without stickiness the follower would go
    # to the idle node. The expected match is the shared part, as no event has arrived yet.
    follower = coord.route("r1", shared + _suffix(2, 40), 8)
    assert follower == Route(first.prefill, "d0", 300)
    assert coord.nodes.load(first.prefill) == 340 + 40
    assert coord.index(first.prefill).match_len(shared) == 0
    # The real cache's events arrive, then the first token: still sticky, now via the index.
    sim = SimPrefill(first.prefill, 4096, page_size=1)
    for event in sim.prefill(shared + _suffix(1, 40)):
        coord.apply_event(event)
    coord.on_prefilled("r0")
    coord.on_prefilled("r1")
    assert coord.nodes.load(first.prefill) == 0
    assert coord.route("r2", shared + _suffix(3, 40), 8) == Route(first.prefill, "d0", 300)


@pytest.mark.timeout(10)
def test_namespaces_are_kept_apart() -> None:
    coord = _make_coordinator(2)
    _insert(coord, "p0", A, namespace="t1")
    _insert(coord, "p1", _tokens(0, 300))  # p1 caches more tokens overall: cold goes to p0
    assert coord.route("x", A + [7], 8, namespace="t2") == Route("p0", "d0", 0)
    coord.on_finished("x")
    assert coord.route("y", A + [7], 8, namespace="t1") == Route("p0", "d0", 200)
    # In flight: "y" is on p0 in t1; the same prompt in t2 does not follow it there.
    assert coord.route("z", A + [8], 8, namespace="t2") == Route("p1", "d0", 0)


@pytest.mark.timeout(10)
def test_other_policies() -> None:
    coord = _make_coordinator(3, policy="round_robin")
    _insert(coord, "p2", A)
    assert [coord.route(f"r{i}", A + [i], 8).prefill for i in range(4)] == [
        "p0",
        "p1",
        "p2",
        "p0",
    ]
    picks = []
    for _ in range(2):
        coord = _make_coordinator(3, policy="random", seed=7)
        picks.append([coord.route(f"r{i}", A + [i], 8).prefill for i in range(12)])
    assert picks[0] == picks[1] and len(set(picks[0])) == 3  # seeded, and uses every node
    coord = _make_coordinator(2, policy="least_load")
    _insert(coord, "p0", A)
    assert coord.route("a", _suffix(1, 50), 8).prefill == "p1"  # idle tie: fewer cached
    assert coord.route("a2", _suffix(2, 60), 8).prefill == "p0"
    # p0 holds all of A, but least_load ignores caches; num_matched still tells what p1 holds.
    assert coord.route("b", A + [1], 8) == Route("p1", "d0", 0)


# -- decode choice and bookkeeping -------------------------------------------------------------


@pytest.mark.timeout(10)
def test_decode_choice_capacity_errors_and_release() -> None:
    coord = _make_coordinator(1, decode_slots=(1000, 2000, 500))
    prompt = _tokens(0, 592)  # + 8 max_tokens = 600 slots
    chosen = [coord.route(f"r{i}", prompt, 8).decode for i in range(4)]
    # unreserved before each: (1000, 2000, 500) -> d1, (1000, 1400) -> d1, (1000, 800) -> d0,
    # (400, 800) -> d1; then (400, 200, 500).
    assert chosen == ["d1", "d1", "d0", "d1"]
    assert coord.route("small", _tokens(0, 442), 8).decode == "d2"  # 450: only d2 fits
    with pytest.raises(NoCapacityError, match="600"):
        coord.route("r4", prompt, 8)
    with pytest.raises(ValueError, match="2001 KV slots; the largest decode node has 2000"):
        coord.route("huge", _tokens(0, 1993), 8)
    # Nothing was booked by the refused routes: the prompts shared with r0 add 1 token each.
    assert coord.nodes.load("p0") == 592 + 3 + 1
    coord.on_finished("r2")  # d0 back to 1000 unreserved
    coord.on_finished("r2")  # a second finish releases nothing more
    coord.on_finished("never-routed")
    assert coord.route("r5", prompt, 8).decode == "d0"
    with pytest.raises(NoCapacityError):
        coord.route("r6", prompt, 8)
    for rid in ("r0", "r1", "r3", "r5", "small"):
        coord.on_finished(rid)
    assert coord.nodes.load("p0") == 0
    assert coord.route("s", _tokens(0, 1992), 8).decode == "d1"  # all 2000 of d1 free again


@pytest.mark.timeout(10)
def test_drain_and_remove_stop_routing_to_a_node() -> None:
    coord = _make_cached_pair()
    coord.nodes.add_decode("d1", 1 << 20)
    coord.nodes.drain("p0")
    coord.nodes.drain("d0")
    assert coord.route("a", A + [1], 8) == Route("p1", "d1", 0)
    coord.nodes.remove("p1")
    assert coord.nodes.prefill_nodes == ["p0"]
    with pytest.raises(NoCapacityError, match="no prefill node"):
        coord.route("b", A + [2], 8)
    coord.on_prefilled("a")  # its prefill node is gone: nothing to update, no error
    coord.on_finished("a")
    coord.nodes.remove("d1")
    assert coord.nodes.decode_nodes == ["d0"]
    coord.nodes.add_prefill("p2")
    with pytest.raises(NoCapacityError, match="no decode node is accepting"):
        coord.route("c", A + [3], 8)  # d0 is draining: a retry may find a new node
    coord.nodes.add_decode("d2", 1 << 20)
    assert coord.route("d", A + [4], 8) == Route("p2", "d2", 0)
    with pytest.raises(KeyError):
        coord.nodes.drain("nope")


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"policy": "fastest"}, "policy must be one of"),
        ({"balance_abs_tokens": -1}, "balance_abs_tokens \\(-1\\)"),
        ({"balance_rel": 0.5}, "balance_rel \\(0.5\\)"),
        ({"cache_threshold": 1.5}, "cache_threshold must be in \\[0, 1\\], got 1.5"),
        ({"cache_threshold": -0.1}, "got -0.1"),
    ],
)
def test_invalid_router_config_raises(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CoordinatorConfig(**kw)


def test_cache_aware_sends_a_follow_up_to_the_decode_node_holding_its_history():
    from pd.core.messages import CacheEventMsg

    coord = Coordinator(CoordinatorConfig(policy="cache_aware"))
    coord.nodes.add_prefill("p0")
    coord.nodes.add_decode("d0", num_slots=1000)
    coord.nodes.add_decode("d1", num_slots=2000)  # more room: the default choice
    history = list(range(100, 400))
    assert coord.route("r0", history[:50], max_tokens=10).decode == "d1"
    coord.on_finished("r0")
    coord.apply_event(
        CacheEventMsg(node_id="d0", seq=0, kind="inserted", namespace="", tokens=history)
    )
    follow_up = history + [7, 8, 9]
    assert coord.route("r1", follow_up, max_tokens=10).decode == "d0"
    coord.on_finished("r1")
    # below the threshold, or under another policy, room decides
    assert coord.route("r2", history[:10] + list(range(5000, 5300)), max_tokens=10).decode == "d1"
    rr = Coordinator(CoordinatorConfig(policy="round_robin"))
    rr.nodes.add_prefill("p0")
    rr.nodes.add_decode("d0", num_slots=1000)
    rr.nodes.add_decode("d1", num_slots=2000)
    rr.apply_event(
        CacheEventMsg(node_id="d0", seq=0, kind="inserted", namespace="", tokens=history)
    )
    assert rr.route("r1", follow_up, max_tokens=10).decode == "d1"


# -- re-routing, node removal and resync -------------------------------------------------------


@pytest.mark.timeout(10)
def test_routing_a_booked_request_again_releases_it_first() -> None:
    coord = _make_coordinator(2, decode_slots=(1000,))
    prompt = _tokens(0, 492)  # + 8 max_tokens = 500 slots
    first = coord.route("r", prompt, 8)
    again = coord.route("r", prompt, 8)  # a retry: one booking, not two
    assert first.prefill == again.prefill and coord.nodes.load(first.prefill) == 492
    coord.route("s", _tokens(5000, 492), 8)  # d0's other 500 slots: r holds only 500
    coord.check_integrity()
    coord.on_finished("r")
    coord.on_finished("s")
    assert coord.nodes.load(first.prefill) == 0
    coord.check_integrity()


@pytest.mark.timeout(10)
def test_a_removed_node_takes_its_bookings_along() -> None:
    coord = _make_coordinator(2, decode_slots=(1000,))
    shared = _tokens(5000, 300)
    route = coord.route("r0", shared + [1], 8)
    coord.nodes.remove(route.prefill)
    coord.nodes.remove("d0")
    coord.check_integrity()
    coord.nodes.add_prefill(route.prefill)  # both register again, empty
    coord.nodes.add_decode("d0", 1000)
    assert coord.nodes.load(route.prefill) == 0
    follower = coord.route("r1", shared + [2], 8)
    assert follower.num_matched == 0  # r0's prompt went with the old node
    coord.on_finished("r0")  # the old booking touches nothing of the new nodes
    coord.check_integrity()
    with pytest.raises(NoCapacityError, match="692"):  # r1 holds 309 of d0's 1000 slots
        coord.route("r2", _tokens(0, 684), 8)
    assert coord.route("r3", _tokens(0, 683), 8).decode == "d0"


@pytest.mark.timeout(10)
def test_a_node_that_missed_events_is_listed_until_its_snapshot_arrives() -> None:
    coord = _make_coordinator(2)
    sim = SimPrefill("p0", 4096, page_size=1)
    cache = sim.cache
    for event in sim.prefill(A + [1]):
        coord.apply_event(event)
    sim.prefill(B + [1])  # its events are lost
    for event in sim.prefill(A + _suffix(1, 10)):
        coord.apply_event(event)
    assert coord.nodes_to_resync == ["p0"]
    assert coord.index("p0").match_len(B) == 0  # the last consistent view
    coord.apply_snapshot("gone", cache.take_snapshot())  # a node removed since: ignored
    coord.apply_snapshot("p0", cache.take_snapshot())
    assert coord.nodes_to_resync == []
    for q in (A, B, A + _suffix(1, 10)):
        assert coord.index("p0").match_len(q) == cache.match_prefix(q).num_tokens
    assert coord.index("p0").num_cached_tokens == cache.num_cached_tokens
    assert coord.route("b", B + [2], 8) == Route("p0", "d0", 200)


# -- conditional disaggregation ----------------------------------------------------------------

LOCAL_TOKENS = 64  # local_prefill_tokens in these tests
MIN_HELD = 0.5


def _local_coordinator(balance: bool = False, **kw: float) -> Coordinator:
    return _make_coordinator(
        local_prefill_tokens=LOCAL_TOKENS,
        local_prefill_min_held=MIN_HELD,
        local_prefill_balance=balance,
        **kw,
    )


def test_short_prompt_goes_to_the_decode_node_alone() -> None:
    coord = _local_coordinator(decode_slots=[1000])
    # nothing cached: the decode node would compute the whole prompt
    assert coord.route("short", _tokens(0, LOCAL_TOKENS), 10) == Route(None, "d0", 0)
    assert coord.route("long", _tokens(5000, LOCAL_TOKENS + 1), 10).prefill is not None
    assert coord.num_local_routes == 1
    # the local request books the decode node's slots and no prefill load
    assert [coord.nodes.load(p) for p in coord.nodes.prefill_nodes] in (
        [LOCAL_TOKENS + 1, 0],
        [0, 65],
    )
    coord.check_integrity()
    coord.on_prefilled("short")  # its first token: nothing of a prefill node to release
    coord.on_finished("short")
    coord.on_finished("long")
    coord.check_integrity()
    # all slots free again: a request needing all 1000 routes
    coord.route("all", _tokens(0, 10), 990)


def test_the_route_log_keeps_where_each_attempt_went() -> None:
    coord = _local_coordinator(decode_slots=[1000])
    short = coord.route("req-1", _tokens(0, LOCAL_TOKENS), 10)
    coord.on_finished("req-1")
    long = coord.route("req-1~1", _tokens(5000, LOCAL_TOKENS + 1), 10)  # its re-route
    coord.route("req-10", _tokens(0, 8), 10)  # another request, whose id starts the same
    got = coord.routes.of("req-1")
    assert [(r.request_id, r.prefill, r.decode) for r in got] == [
        ("req-1", None, "d0"),
        ("req-1~1", long.prefill, long.decode),
    ]
    assert got[0].num_matched == short.num_matched and got[1].pull_from is None
    assert coord.routes.of("req-2") == []


def test_decode_node_holding_the_rest_prefills_it() -> None:
    coord = _local_coordinator()
    history = _tokens(0, 500)
    turn = history + _tokens(1000, 100)  # 100 new tokens: more than LOCAL_TOKENS
    _insert(coord, "d0", history)
    # only the decode node holds it, and 500/600 >= MIN_HELD
    assert coord.route("turn2", turn, 16) == Route(None, "d0", 500)
    # while d0 prefills it, the same prompt again waits for it there
    assert coord.route("turn2-twin", turn, 16) == Route(None, "d0", 599)
    for rid in ("turn2", "turn2-twin"):
        coord.on_finished(rid)
    coord.check_integrity()
    # a prefill node holding more of it wins: the decode node would compute more
    _insert(coord, "p1", turn[:550])
    route = coord.route("turn2-again", turn, 16)
    assert (route.prefill, route.num_matched) == ("p1", 550)
    # a prefill node holding as much: no transfer beats a transfer
    coord2 = _local_coordinator()
    _insert(coord2, "d0", history)
    _insert(coord2, "p0", history)
    assert coord2.route("r", turn, 16).prefill is None


def test_decode_node_never_computes_again_what_a_prefill_node_holds() -> None:
    """Neither the short rule nor balance sends a prompt to a decode node holding less of it
    than a prefill node: the hit rate would drop and the prefix would be stranded there."""
    coord = _local_coordinator(balance=True, num_prefill=1)
    system = _tokens(0, 512)
    _insert(coord, "p0", system)
    # short: LOCAL_TOKENS tokens in all, but the first 32 are held by p0 and not by d0
    route = coord.route("short", system[:32] + _tokens(7000, LOCAL_TOKENS - 32), 16)
    assert (route.prefill, route.num_matched) == ("p0", 32)
    # balance: p0 is busy with a cold 2,000-token prompt; d0 would be sooner, but it would
    # compute the system prompt p0 holds
    assert coord.route("busy", _tokens(50_000, 2000), 16).prefill == "p0"
    route = coord.route("turn", system + _tokens(9000, 200), 16)
    assert (route.prefill, route.num_matched) == ("p0", 512)
    # a cold prompt under the same load still goes to the decode node
    assert coord.route("cold", _tokens(60_000, 700), 16).prefill is None
    for rid in ("short", "busy", "turn", "cold"):
        coord.on_finished(rid)
    coord.check_integrity()


def test_decode_node_holding_less_than_min_held_does_not_prefill() -> None:
    coord = _local_coordinator()
    _insert(coord, "d0", _tokens(0, 200))
    # 200 of 600 held (< MIN_HELD), 400 left (> LOCAL_TOKENS)
    assert coord.route("r", _tokens(0, 200) + _tokens(5000, 400), 16).prefill is not None


def test_local_routing_off_or_refused() -> None:
    off = _make_coordinator(local_prefill_tokens=-1)
    assert off.route("r", _tokens(0, 4), 4).prefill is not None
    on = _local_coordinator()
    assert on.route("warm", _tokens(0, 4), 4, allow_local=False).prefill is not None
    assert on.num_local_routes == 0


def test_without_a_prefill_pool_every_request_is_prefilled_on_its_decode_node() -> None:
    """``decode_only`` (the prefill pool's target is 0): long cold prompts, a decode node that
    is decoding, warm-ups and ``local_prefill_tokens=-1`` all go to a decode node alone; a
    prefill node that joins takes the prompts the rules give it again."""
    coord = _make_coordinator(num_prefill=0, decode_slots=(1 << 20, 1 << 20))
    with pytest.raises(NoCapacityError, match="no prefill node"):
        coord.route("waits", _tokens(0, 900), 8)  # the pool is empty while a node replaces one
    coord.set_decode_only(True)
    _insert(coord, "d1", _tokens(0, 600))
    assert coord.route("a", _tokens(0, 900), 8) == Route(None, "d1", 600)  # the cache-aware pick
    coord.on_prefilled("a")  # d1 decodes "a" now
    assert coord.route("b", _tokens(5000, 900), 8).prefill is None
    assert coord.route("warm", _tokens(7000, 50), 1, allow_local=False).prefill is None
    assert coord.num_local_routes == 3
    coord.check_integrity()
    coord.nodes.add_prefill("p0")  # grown again: local_prefill_tokens=-1 sends everything there
    assert coord.route("c", _tokens(9000, 900), 8).prefill == "p0"
    coord.nodes.drain("p0")  # and shrunk to 0 again: no node accepts, the decode nodes prefill
    assert coord.route("d", _tokens(9500, 900), 8).prefill is None
    for rid in ("a", "b", "warm", "c", "d"):
        coord.on_finished(rid)
    coord.check_integrity()


def test_local_routing_follows_the_decode_nodes_room() -> None:
    """The local rule looks at the decode node chosen for room: a full node is not used."""
    coord = _local_coordinator(decode_slots=[100, 1000])
    _insert(coord, "d0", _tokens(0, 500))
    coord.route("fill", _tokens(9000, 10), 85)  # d1 has the most room: it takes this one
    route = coord.route("r", _tokens(0, 550), 16)  # d0 holds 500 but has no room for 566
    assert route.decode == "d1" and route.prefill is not None
    coord.check_integrity()


@pytest.mark.parametrize("kw", [dict(local_prefill_tokens=-2), dict(local_prefill_min_held=0.0)])
def test_bad_local_settings_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="local_prefill"):
        CoordinatorConfig(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("namespace", ["", "tenant"])
def test_a_prompt_shorter_than_a_page_books_and_releases(namespace: str) -> None:
    """Its page-aligned key is empty: nothing is pending, and its release finds nothing."""
    coord = _make_coordinator(page_size=16)
    route = coord.route("r", _tokens(0, 6), 8, namespace)
    coord.check_integrity()
    coord.on_prefilled("r")
    coord.on_finished("r")
    coord.check_integrity()
    assert coord.nodes.load(route.prefill) == 0


def test_a_burst_of_cold_prompts_is_prefilled_on_both_sides() -> None:
    """Balance: the decode node takes a prompt when its queue of local prefills plus the prompt
    is shorter than the prefill node's queue plus its part of the prompt."""
    coord = _local_coordinator(balance=True, num_prefill=1)
    cold = [_tokens(1000 * (i + 1), 640) for i in range(4)]
    routes = [coord.route(f"c{i}", p, 32).prefill for i, p in enumerate(cold)]
    assert routes == ["p0", None, "p0", None]  # 640 vs 0+640; 640 vs 640+640; 1280 vs 1280; ...
    coord.check_integrity()
    # a follower whose prefix the prefill node is computing: 20 tokens there beat 660 here
    # (the decode node's queue of 1280 aside)
    assert coord.route("f", cold[0] + _tokens(90_000, 20), 32).prefill == "p0"
    for rid in ("c0", "c1", "c2", "c3", "f"):
        coord.on_prefilled(rid)
    coord.check_integrity()
    # both queues empty again: a cold prompt goes to the prefill node (a tie is not sooner)
    assert coord.route("c4", _tokens(50_000, 640), 32).prefill == "p0"
    for rid in ("c0", "c1", "c2", "c3", "f", "c4"):
        coord.on_finished(rid)
    coord.check_integrity()


def test_a_burst_of_cold_chat_prompts_sharing_an_opening_is_prefilled_on_both_sides() -> None:
    """Cold chat prompts share the template's opening (a system prompt): the prefill node is
    expected to hold it once the first is booked there, which must not keep the rest off the
    idle decode node; computing again more than a short prefill of what it holds still does."""
    coord = _local_coordinator(balance=True, num_prefill=1)
    opening = _tokens(500, 40)
    cold = [opening + _tokens(1000 * (i + 1), 600) for i in range(4)]
    routes = [coord.route(f"c{i}", p, 32).prefill for i, p in enumerate(cold)]
    # local 640 against 600 there: 640 + 128 < 640 + 600; then 640 + 640 + 128 < 1240 + 600 ...
    assert routes == ["p0", None, "p0", None]
    coord.check_integrity()
    # the opening and 200 more tokens held there: 240 > 128 of them would be computed again
    shared = opening + _tokens(1000, 200) + _tokens(60_000, 400)
    for rid in ("c0", "c1", "c2", "c3"):
        coord.on_finished(rid)
    _insert(coord, "p0", cold[0])
    assert coord.route("big", _tokens(70_000, 3000), 32).prefill == "p0"  # a long queue there
    assert coord.route("shared", shared, 32).prefill == "p0"
    for rid in ("big", "shared"):
        coord.on_finished(rid)
    coord.check_integrity()


def test_balance_off_keeps_cold_prompts_on_the_prefill_side() -> None:
    coord = _local_coordinator(balance=False, num_prefill=1)
    routes = [coord.route(f"c{i}", _tokens(1000 * (i + 1), 640), 32).prefill for i in range(4)]
    assert routes == ["p0"] * 4


def test_only_short_local_prefills_while_the_decode_node_decodes() -> None:
    """Held-most and balance need an idle decode node (a long prefill there would stretch its
    streams' TPOT); the short rule does not."""
    coord = _local_coordinator(balance=True, num_prefill=1)
    history = _tokens(0, 500)
    _insert(coord, "d0", history)
    coord.route("running", _tokens(70_000, 10), 32)  # short: local
    coord.on_prefilled("running")  # its first token: d0 now decodes it
    turn = history + _tokens(1000, 100)
    assert coord.route("turn", turn, 16).prefill == "p0"  # held-most, but d0 is busy
    assert coord.route("cold", _tokens(80_000, 640), 16).prefill == "p0"  # balance: same
    assert coord.route("short", _tokens(90_000, 20), 16).prefill is None
    coord.check_integrity()
    coord.on_finished("running")
    coord.on_finished("short")
    # idle again: held-most (p0 is expected to hold "turn" whole, so another next turn)
    assert coord.route("turn-again", history + _tokens(2000, 100), 16).prefill is None
    for rid in ("turn", "cold", "turn-again"):
        coord.on_finished(rid)
    coord.check_integrity()


def test_balance_keeps_a_near_tie_disaggregated() -> None:
    """Idle nodes, the decode node holding a few more tokens of a long prompt (a chat
    template's opening): sooner by less than LOCAL_TOKENS is not sooner."""
    coord = _local_coordinator(balance=True, num_prefill=1)
    _insert(coord, "d0", _tokens(0, 5))
    assert coord.route("r", _tokens(0, 640), 32).prefill == "p0"


@pytest.mark.timeout(10)
def test_requests_without_max_tokens_book_what_their_answers_use() -> None:
    """32 chat requests without max_tokens (the server gives each the rest of an 8,192-token
    context) on one decode node of 32,768 slots: all 32 are booked at once, 400 + 512 slots
    each (booking prompt + max_tokens, 8,192 each, let 4 in and made the 5th wait). Each
    booking grows with its answer, to its tokens and as many again, past the node's slots if
    need be (the node retracts when its pool runs out); new requests wait meanwhile, and every
    slot comes back when they finish."""
    ctx, slots, prompt_len, n = 8192, 32768, 400, 32
    coord = _make_coordinator(1, decode_slots=(slots,))
    for i in range(n):
        route = coord.route(f"r{i}", _tokens(10_000 * (i + 1), prompt_len), ctx - prompt_len)
        assert route.decode == "d0"
    coord.check_integrity()
    assert coord.nodes.num_reserved_slots("d0") == n * (prompt_len + 512)
    for i in range(n):  # the first token, then 99 more in bursts: within the first 512
        coord.on_prefilled(f"r{i}")
        for num in (1, 50, 49):
            coord.on_tokens(f"r{i}", num)
    assert coord.nodes.num_reserved_slots("d0") == n * (prompt_len + 100 + 512)
    coord.check_integrity()
    for i in range(n):  # 700 tokens each: booked for 1,400
        coord.on_tokens(f"r{i}", 600)
    assert coord.nodes.num_reserved_slots("d0") == n * (prompt_len + 1400) > slots
    coord.check_integrity()
    with pytest.raises(NoCapacityError, match="912 free KV slots"):
        coord.route("late", _tokens(0, prompt_len), ctx - prompt_len)
    coord.on_tokens("r0", 10_000)  # never past prompt + max_tokens
    coord.check_integrity()
    for i in range(n):
        coord.on_finished(f"r{i}")
        coord.on_tokens(f"r{i}", 5)  # after its end: nothing grows
    assert coord.nodes.num_reserved_slots("d0") == 0
    coord.check_integrity()
    # a request that may never fit is still refused on prompt + max_tokens, with pages
    with pytest.raises(ValueError, match="32769 KV slots; the largest decode node has 32768"):
        coord.route("huge", _tokens(0, 400), slots - 400 + 1)
    page = _make_coordinator(1, decode_slots=(1024,), page_size=16)
    page.route("p", _tokens(0, 10), 8)  # 18 tokens: two pages
    assert page.nodes.num_reserved_slots("d0") == 32
    page.on_tokens("p", 3)
    page.check_integrity()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_decode_node_never_expects_more_than_the_coordinator_booked(page_size: int) -> None:
    """The two views of one request: the coordinator's booking and the decode node's
    admission estimate (``SlotBudget.expected_len``, in whole pages), at every ratio the node
    may be at, before and as its answer grows; the node's never exceeds the booking, so the
    node admits what the coordinator sent it while the bookings fit its slots."""
    for prompt_len, max_tokens in [(10, 8), (400, 7792), (3000, 100), (100, 600), (5, 9000)]:
        for num_output in (0, 1, 100, 511, 512, 513, 2000, max_tokens - 1):
            if not 0 <= num_output < max_tokens:
                continue
            coord = _make_coordinator(1, decode_slots=(1 << 20,), page_size=page_size)
            coord.route("r", _tokens(0, prompt_len), max_tokens)
            coord.on_tokens("r", num_output)
            booked = coord.nodes.num_reserved_slots("d0")
            coord.check_integrity()
            for ratio in (1.0, 0.7, 0.14):
                alloc = SlotAllocator(16384, page_size)
                budget = SlotBudget(alloc, NoPrefixCache(alloc), new_token_ratio=ratio)
                req = Req("r", _tokens(0, prompt_len), SamplingParams(max_tokens=max_tokens))
                req.output_ids = [7] * num_output
                req.fill_len = prompt_len + num_output
                expected = alloc.num_pages_for(budget.expected_len(req)) * page_size
                assert expected <= booked, (prompt_len, max_tokens, num_output, ratio)
