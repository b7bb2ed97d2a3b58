"""What ``scripts/simulate_routing.py`` runs (its model of a prefill pool): a seeded trace of
shared-prefix sessions, one real RadixCache per simulated prefill node, and the real Coordinator.

Trace: ``num_groups`` groups (a system prompt or document each, ``prefix_len`` tokens) of
``sessions_per_group`` sessions; a request picks a session uniformly and sends its group prefix,
its own history (``history_len`` tokens, the same every turn) and a new message
(``message_len`` tokens), 2,048 tokens in all by default. Token ids are drawn from SmolLM2's
vocabulary.

Each request is routed, then prefilled at once by its node's cache the way a prefill node does
it (match the prompt, lock, make room, extend, ``cache_finished``), so evictions happen. The
coordinator hears of it (the node's cache events, then the first token and the finish) only
after ``in_flight`` more requests were routed, as if those prefills were still running.

Every call to the coordinator is recorded, and ``replay`` feeds them to a fresh one with no
simulated caches beside it: that is the coordinator's cost as a cluster sees it, while timing it
beside gigabytes of simulated caches mostly measures how cold those leave the CPU caches.
"""

from __future__ import annotations

import random
import time
import tracemalloc
from array import array
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import msgspec

from pd.cache.prefix_index import SharedPrefixIndex
from pd.cache.radix_cache import RadixCache
from pd.cache.radix_tree import RadixTree
from pd.core.kv_pool import SlotAllocator
from pd.core.messages import CacheEventMsg
from pd.router.coordinator import Coordinator
from pd.router.policy import CoordinatorConfig

VOCAB = 49152  # SmolLM2's vocabulary
MAX_TOKENS = 64  # decode budget booked per request (decode nodes never run out here)


@dataclass(frozen=True)
class TraceConfig:
    num_groups: int
    sessions_per_group: int = 64
    prefix_len: int = 1024
    history_len: int = 896
    message_len: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.num_groups, self.sessions_per_group, self.message_len) < 1:
            raise ValueError(f"groups, sessions and message length must be >= 1: {self}")
        if min(self.prefix_len, self.history_len) < 0:
            raise ValueError(f"prefix and history lengths must be >= 0: {self}")


def make_trace(cfg: TraceConfig, num_requests: int) -> Iterator[list[int]]:
    """Prompts as a tokenizer returns them: fresh lists of fresh ints."""
    rng = random.Random(cfg.seed)
    vocab = range(VOCAB)
    prefixes = [array("I", rng.choices(vocab, k=cfg.prefix_len)) for _ in range(cfg.num_groups)]
    histories: dict[int, array[int]] = {}
    for _ in range(num_requests):
        group = rng.randrange(cfg.num_groups)
        session = group * cfg.sessions_per_group + rng.randrange(cfg.sessions_per_group)
        history = histories.get(session)
        if history is None:
            history = histories[session] = array("I", rng.choices(vocab, k=cfg.history_len))
        message = array("I", rng.choices(vocab, k=cfg.message_len))
        yield (prefixes[group] + history + message).tolist()


class SimPrefill:
    """A prefill node's cache side: a real RadixCache over its own SlotAllocator."""

    def __init__(self, node_id: str, num_slots: int, page_size: int) -> None:
        self.cache = RadixCache(SlotAllocator(num_slots, page_size), node_id)
        self.num_prompt_tokens = 0
        self.num_hit_tokens = 0

    def prefill(self, prompt: list[int]) -> list[CacheEventMsg]:
        """Run one request through the cache as a prefill node does; returns its events."""
        cache = self.cache
        m = cache.match_prompt(prompt)
        cache.inc_lock_ref(m.last_node)
        assert cache.make_room(
            cache.allocator.num_new_pages(m.slots, len(prompt)) * cache.page_size
        )
        slots = cache.allocator.extend(m.slots, len(prompt))
        cache.cache_finished(prompt, slots, m.last_node)
        self.num_prompt_tokens += len(prompt)
        self.num_hit_tokens += m.num_tokens
        return cache.take_events()


class Routed(NamedTuple):
    """A recorded ``route`` call and the prefill node it chose."""

    index: int  # of the request in the trace
    prompt: array[int]
    prefill: str


class Prefilled(NamedTuple):
    """A recorded prefill: the node's cache events (on the wire), then the request's first
    token and finish."""

    index: int
    events: list[bytes]


class SimResult(NamedTuple):
    num_cached_tokens: int  # all nodes' caches at the end
    hit_rate: float  # matched / prompt tokens, counted by the caches (second half)
    imbalance: float  # max / mean prompt tokens routed to a node (second half)
    decision_seconds: list[float]  # per request of the second half, timed beside the caches
    nodes: dict[str, SimPrefill]
    calls: list[Routed | Prefilled]  # what the coordinator was told, in order


class Timing(NamedTuple):
    decision_seconds: list[float]  # per request of the second half: route + on_prefilled +
    # on_finished, wall clock (a median is robust to other jobs taking the CPU, a mean is not)
    num_events: int
    event_seconds: float  # apply_event, all events delivered in the second half


def make_coordinator(policy: str, num_nodes: int, page_size: int, seed: int) -> Coordinator:
    coord = Coordinator(
        CoordinatorConfig(policy=policy, page_size=page_size, seed=seed, local_prefill_tokens=-1)
    )
    for i in range(num_nodes):
        coord.nodes.add_prefill(f"p{i}")
    coord.nodes.add_decode("d0", 1 << 40)
    return coord


def simulate(
    coord: Coordinator,
    node_tokens: int,
    trace: TraceConfig,
    num_requests: int,
    *,
    page_size: int,
    in_flight: int,
) -> SimResult:
    """Run the trace through ``coord`` and a simulated cache per prefill node, recording every
    call to the coordinator."""
    nodes = {n: SimPrefill(n, node_tokens, page_size) for n in coord.nodes.prefill_nodes}
    window: deque[tuple[int, list[CacheEventMsg]]] = deque()
    calls: list[Routed | Prefilled] = []
    routed: Counter[str] = Counter()
    spent: dict[int, float] = {}
    warmup = num_requests // 2
    hits = prompts = 0
    clock = time.perf_counter
    for i, prompt in enumerate(make_trace(trace, num_requests)):
        if i == warmup:
            hits, prompts = _hits(nodes)
            routed.clear()
        calls.append(Routed(i, array("I", prompt), ""))
        t0 = clock()
        route = coord.route(f"r{i}", prompt, MAX_TOKENS)
        spent[i] = clock() - t0
        calls[-1] = calls[-1]._replace(prefill=route.prefill)
        routed[route.prefill] += len(prompt)
        window.append((i, nodes[route.prefill].prefill(prompt)))
        while len(window) > in_flight or (window and i == num_requests - 1):
            done, events = window.popleft()
            calls.append(Prefilled(done, [msgspec.msgpack.encode(e) for e in events]))
            for event in events:
                coord.apply_event(event)
            t0 = clock()
            coord.on_prefilled(f"r{done}")
            coord.on_finished(f"r{done}")
            spent[done] += clock() - t0
    coord.check_integrity()
    for node_id, sim in nodes.items():
        index = coord.index(node_id)
        assert not index.needs_resync and index.num_cached_tokens == sim.cache.num_cached_tokens
    end_hits, end_prompts = _hits(nodes)
    loads = [routed[n] for n in nodes]
    return SimResult(
        sum(s.cache.num_cached_tokens for s in nodes.values()),
        (end_hits - hits) / (end_prompts - prompts),
        max(loads) * len(loads) / sum(loads),
        [spent[i] for i in range(warmup, num_requests)],
        nodes,
        calls,
    )


def replay(coord: Coordinator, calls: list[Routed | Prefilled], num_requests: int) -> Timing:
    """Feed a fresh ``coord`` the recorded calls, with no simulated caches in the process (as in
    a cluster, where they live on the nodes): it must decide as it did. Decoding the events off
    the wire is the cluster client's work and is not timed."""
    decoder = msgspec.msgpack.Decoder(CacheEventMsg)
    warmup = num_requests // 2
    spent: dict[int, float] = {}
    num_events, event_seconds = 0, 0.0
    clock = time.perf_counter
    for call in calls:
        if isinstance(call, Routed):
            prompt = call.prompt.tolist()
            t0 = clock()
            route = coord.route(f"r{call.index}", prompt, MAX_TOKENS)
            spent[call.index] = clock() - t0
            assert route.prefill == call.prefill, f"request {call.index} went elsewhere"
            continue
        events = [decoder.decode(raw) for raw in call.events]
        t0 = clock()
        for event in events:
            coord.apply_event(event)
        t1 = clock()
        coord.on_prefilled(f"r{call.index}")
        coord.on_finished(f"r{call.index}")
        spent[call.index] += clock() - t1
        if call.index >= warmup:
            num_events += len(events)
            event_seconds += t1 - t0
    coord.check_integrity()
    return Timing([spent[i] for i in range(warmup, num_requests)], num_events, event_seconds)


def _hits(nodes: dict[str, SimPrefill]) -> tuple[int, int]:
    return sum(s.num_hit_tokens for s in nodes.values()), sum(
        s.num_prompt_tokens for s in nodes.values()
    )


def mirror_bytes(
    nodes: dict[str, SimPrefill], page_size: int, max_baseline_nodes: int
) -> tuple[float, float]:
    """Bytes per cached token of (the SharedPrefixIndex, one RadixTree per node, as the
    previous PrefixIndex kept) rebuilt from every node's snapshot as it arrives on the wire
    (msgpack), traced by tracemalloc. The baseline covers the first ``max_baseline_nodes``."""
    wire = {
        n: [msgspec.msgpack.encode(e) for e in s.cache.take_snapshot()] for n, s in nodes.items()
    }
    decoder = msgspec.msgpack.Decoder(CacheEventMsg)
    tracemalloc.start()
    mirror = SharedPrefixIndex(page_size)
    for node_id, events in wire.items():
        index = mirror.add(node_id)
        for raw in events:
            index.apply(decoder.decode(raw))
    shared = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    sample = list(wire)[:max_baseline_nodes]
    tracemalloc.start()
    trees = {n: RadixTree(page_size) for n in sample}
    for node_id in sample:
        for raw in wire[node_id]:
            event = decoder.decode(raw)
            trees[node_id].insert(event.tokens, None, event.namespace)
    baseline = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    num_tokens = sum(s.cache.num_cached_tokens for s in nodes.values())
    num_sample = sum(nodes[n].cache.num_cached_tokens for n in sample)
    return shared / num_tokens, baseline / num_sample
