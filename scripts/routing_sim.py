"""The routing simulation behind ``simulate_routing.py``: a seeded trace of shared-prefix
sessions, one real RadixCache per simulated prefill node, and the real Coordinator.

Trace: ``num_groups`` groups (a system prompt or document each, ``prefix_len`` tokens) of
``sessions_per_group`` sessions; a request picks a session uniformly and sends its group prefix,
its own history (``history_len`` tokens, the same every turn) and a new message
(``message_len`` tokens), 2,048 tokens in all by default. Token ids are drawn from SmolLM2's
vocabulary.

Each request is routed, then prefilled at once by its node's cache the way a prefill node does
it (match the prompt, lock, make room, extend, ``cache_finished``), so evictions happen. The
coordinator hears of it (the node's cache events, then the first token and the finish) only
after ``in_flight`` more requests were routed, as if those prefills were still running.
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
from pd.coordinator import Coordinator, CoordinatorConfig
from pd.engine.kv_pool import SlotAllocator
from pd.messages import CacheEventMsg

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


class SimResult(NamedTuple):
    policy: str
    num_nodes: int
    num_cached_tokens: int  # all nodes' caches at the end
    decision_seconds: list[float]  # per request of the second half: route + on_prefilled +
    # on_finished, wall clock (a median is robust to other jobs taking the CPU, a mean is not)
    num_events: int
    event_seconds: float  # apply_event, all events of the second half
    hit_rate: float  # matched / prompt tokens, counted by the caches (second half)
    imbalance: float  # max / mean prompt tokens routed to a node (second half)
    nodes: dict[str, SimPrefill]


def simulate(
    policy: str,
    num_nodes: int,
    node_tokens: int,
    trace: TraceConfig,
    num_requests: int,
    *,
    page_size: int,
    in_flight: int,
) -> SimResult:
    coord = Coordinator(CoordinatorConfig(policy=policy, page_size=page_size, seed=trace.seed))
    nodes = {f"p{i}": SimPrefill(f"p{i}", node_tokens, page_size) for i in range(num_nodes)}
    for node_id in nodes:
        coord.add_prefill(node_id)
    coord.add_decode("d0", 1 << 40)
    window: deque[tuple[str, list[CacheEventMsg]]] = deque()
    routed: Counter[str] = Counter()
    spent: dict[str, float] = {}  # request id -> seconds inside the coordinator
    num_events, event_seconds = 0, 0.0
    warmup = num_requests // 2
    hits = prompts = 0
    clock = time.perf_counter
    for i, prompt in enumerate(make_trace(trace, num_requests)):
        if i == warmup:
            hits, prompts = _hits(nodes)
            num_events, event_seconds = 0, 0.0
            routed.clear()
        rid = f"r{i}"
        t0 = clock()
        route = coord.route(rid, prompt, MAX_TOKENS)
        spent[rid] = clock() - t0
        routed[route.prefill] += len(prompt)
        window.append((rid, nodes[route.prefill].prefill(prompt)))
        while len(window) > in_flight or (window and i == num_requests - 1):
            done, events = window.popleft()
            t0 = clock()
            for event in events:
                coord.apply_event(event)
            t1 = clock()
            coord.on_prefilled(done)
            coord.on_finished(done)
            spent[done] += clock() - t1
            event_seconds += t1 - t0
            num_events += len(events)
    coord.check_integrity()
    for node_id, sim in nodes.items():
        index = coord.index(node_id)
        assert not index.needs_resync and index.num_cached_tokens == sim.cache.num_cached_tokens
    end_hits, end_prompts = _hits(nodes)
    loads = [routed[n] for n in nodes]
    return SimResult(
        policy,
        num_nodes,
        sum(s.cache.num_cached_tokens for s in nodes.values()),
        [spent[f"r{i}"] for i in range(warmup, num_requests)],
        num_events,
        event_seconds,
        (end_hits - hits) / (end_prompts - prompts),
        max(loads) * len(loads) / sum(loads),
        nodes,
    )


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
