"""The coordinator: picks a prefill node and a decode node for each request.

Prefill node (policy ``cache_aware``, SGLang's cache-aware routing, with an exact view):

1. Loads are unbalanced when ``max - min > balance_abs_tokens`` and
   ``max > balance_rel * min`` (load = prompt tokens routed to the node and not yet
   prefilled): go to the least-loaded node.
2. Else go to the node holding the longest prefix of the prompt, if it covers at least
   ``cache_threshold`` of the prompt. What a node holds is replayed from its cache events
   (``PrefixIndex``), plus the prompts routed to it whose prefill has not finished yet (they
   will be in its cache by the time a follower is admitted there).
3. Else the least-loaded node. Ties (e.g. all idle) go to the node caching the fewest
   tokens: otherwise an idle cluster would pin every new prefix to the same first node.

``round_robin``, ``random`` and ``least_load`` are there for comparison.
Decode node, among those with enough unreserved KV slots for prompt + max_tokens: under
``cache_aware``, the one whose own cache (decode nodes keep what they decoded, mirrored from
their events too) holds at least ``cache_threshold`` of the prompt, longest first, so a
conversation's next turn returns to the node that has its history and less KV moves; else,
and under the other policies, the one with the most unreserved slots.
A node whose cache events were lost (a seq gap) is listed in ``nodes_to_resync``, answered from
its last consistent view, until the reset event of its snapshot arrives in its event stream.
All of this is plain Python: the cluster client feeds it events and request life-cycle calls.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pd.cache.prefix_index import PrefixIndex
from pd.messages import CacheEventMsg

POLICIES = ("cache_aware", "round_robin", "random", "least_load")


@dataclass(frozen=True)
class CoordinatorConfig:
    policy: str = "cache_aware"
    balance_abs_tokens: int = 4096  # loads must differ by more than this many tokens ...
    balance_rel: float = 2.0  # ... and by more than this factor to count as unbalanced
    cache_threshold: float = 0.25  # matched fraction of the prompt that makes a node sticky
    page_size: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.balance_abs_tokens < 0 or self.balance_rel < 1.0:
            raise ValueError(
                f"balance_abs_tokens ({self.balance_abs_tokens}) must be >= 0 and "
                f"balance_rel ({self.balance_rel}) >= 1"
            )
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")


class Route(NamedTuple):
    prefill: str
    decode: str
    num_matched: int  # prompt tokens the chosen prefill node is expected to hold


class NoCapacityError(RuntimeError):
    """No decode node has room for the request right now (it may later)."""


@dataclass
class _Prefill:
    index: PrefixIndex
    load: int = 0
    inflight: dict[str, tuple[list[int], str, int]] = field(
        default_factory=dict
    )  # rid -> (prompt, ns, load)
    draining: bool = False


@dataclass
class _Decode:
    num_slots: int
    index: PrefixIndex
    reserved: int = 0
    draining: bool = False


class Coordinator:
    def __init__(self, cfg: CoordinatorConfig) -> None:
        self.cfg = cfg
        self._prefill: dict[str, _Prefill] = {}
        self._decode: dict[str, _Decode] = {}
        self._requests: dict[str, tuple[str, str, int]] = {}  # rid -> (prefill, decode, reserved)
        self._rr = itertools.count()
        self._rng = random.Random(cfg.seed)

    # -- membership -------------------------------------------------------------------------

    def add_prefill(self, node_id: str) -> None:
        self._prefill[node_id] = _Prefill(PrefixIndex(self.cfg.page_size, node_id))

    def add_decode(self, node_id: str, num_slots: int) -> None:
        self._decode[node_id] = _Decode(num_slots, PrefixIndex(self.cfg.page_size, node_id))

    def drain(self, node_id: str) -> None:
        """Send no new requests to this node."""
        (self._prefill.get(node_id) or self._decode[node_id]).draining = True

    def remove(self, node_id: str) -> None:
        self._prefill.pop(node_id, None)
        self._decode.pop(node_id, None)

    @property
    def prefill_nodes(self) -> list[str]:
        return list(self._prefill)

    @property
    def decode_nodes(self) -> list[str]:
        return list(self._decode)

    def index(self, node_id: str) -> PrefixIndex:
        return self._prefill[node_id].index

    def load(self, node_id: str) -> int:
        return self._prefill[node_id].load

    # -- events and life cycle --------------------------------------------------------------

    def apply_event(self, event: CacheEventMsg) -> None:
        node = self._prefill.get(event.node_id) or self._decode.get(event.node_id)
        if node is not None:
            node.index.apply(event)

    def nodes_to_resync(self) -> list[str]:
        """Nodes whose mirror missed cache events: ask each for a snapshot (its reset event
        and the ``inserted`` events after it rebuild the mirror)."""
        nodes = [*self._prefill.items(), *self._decode.items()]
        return [node_id for node_id, node in nodes if node.index.needs_resync]

    def route(
        self, request_id: str, prompt_ids: Sequence[int], max_tokens: int, namespace: str = ""
    ) -> Route:
        """Pick both nodes and book the request on them; raises NoCapacityError if no decode
        node has room now, ValueError if none ever could."""
        page = self.cfg.page_size
        need = -(-(len(prompt_ids) + max_tokens) // page) * page  # decode nodes take whole pages
        decode = self._pick_decode(need, prompt_ids, namespace)
        prefill, matched = self._pick_prefill(prompt_ids, namespace)
        node = self._prefill[prefill]
        load = len(prompt_ids) - matched
        node.load += load
        node.inflight[request_id] = (list(prompt_ids), namespace, load)
        self._decode[decode].reserved += need
        self._requests[request_id] = (prefill, decode, need)
        return Route(prefill, decode, matched)

    def on_prefilled(self, request_id: str) -> None:
        """The prefill node produced the first token: its prefill load is gone."""
        entry = self._requests.get(request_id)
        if entry is None:
            return
        node = self._prefill.get(entry[0])
        if node is not None and request_id in node.inflight:
            node.load -= node.inflight.pop(request_id)[2]

    def on_finished(self, request_id: str) -> None:
        self.on_prefilled(request_id)
        entry = self._requests.pop(request_id, None)
        if entry is not None and entry[1] in self._decode:
            self._decode[entry[1]].reserved -= entry[2]

    # -- choices ----------------------------------------------------------------------------

    def _pick_decode(self, need: int, prompt: Sequence[int], namespace: str) -> str:
        nodes = {n: d for n, d in self._decode.items() if not d.draining}
        if not nodes:  # like the prefill side: one may register (or return) later
            raise NoCapacityError("no decode node is accepting requests")
        if all(need > d.num_slots for d in nodes.values()):
            most = max(d.num_slots for d in nodes.values())
            raise ValueError(f"request needs {need} KV slots; the largest decode node has {most}")
        fits = [
            (d.num_slots - d.reserved, n)
            for n, d in nodes.items()
            if d.num_slots - d.reserved >= need
        ]
        if not fits:
            raise NoCapacityError(f"no decode node has {need} free KV slots right now")
        if self.cfg.policy == "cache_aware":
            matched, free, node = max(
                (self._decode[n].index.match_len(prompt[:-1], namespace), free, n)
                for free, n in fits
            )
            if matched and matched >= self.cfg.cache_threshold * len(prompt):
                return node
        return max(fits)[1]

    def _pick_prefill(self, prompt: Sequence[int], namespace: str) -> tuple[str, int]:
        nodes = [n for n, p in self._prefill.items() if not p.draining]
        if not nodes:
            raise NoCapacityError("no prefill node is accepting requests")
        policy = self.cfg.policy
        if policy == "round_robin":
            node = nodes[next(self._rr) % len(nodes)]
        elif policy == "random":
            node = self._rng.choice(nodes)
        elif policy == "least_load" or self._is_unbalanced(nodes):
            node = self._least_loaded(nodes)
        else:
            best, best_len = self._least_loaded(nodes), 0
            for n in nodes:
                m = self._match_len(n, prompt, namespace)
                if m > best_len or (m == best_len and m and self.load(n) < self.load(best)):
                    best, best_len = n, m
            if best_len < self.cfg.cache_threshold * len(prompt) or best_len == 0:
                best = self._least_loaded(nodes)
            node = best
        return node, self._match_len(node, prompt, namespace)

    def _is_unbalanced(self, nodes: list[str]) -> bool:
        loads = [self.load(n) for n in nodes]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.cfg.balance_abs_tokens and hi > self.cfg.balance_rel * lo

    def _least_loaded(self, nodes: list[str]) -> str:
        def key(n: str) -> tuple[int, int, int]:
            node = self._prefill[n]
            return node.load, len(node.inflight), node.index.num_cached_tokens

        return min(nodes, key=key)

    def _match_len(self, node_id: str, prompt: Sequence[int], namespace: str) -> int:
        node = self._prefill[node_id]
        best = node.index.match_len(prompt[:-1], namespace)
        for other, ns, _ in node.inflight.values():
            if ns == namespace and len(other) > best:
                best = max(best, _common_prefix(prompt[:-1], other))
        page = self.cfg.page_size
        return best // page * page


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
