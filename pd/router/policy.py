"""``RoutePolicy``: which nodes a request goes to. It chooses; the coordinator books.

``choose`` takes these steps, in this order (``cache_aware``, the default; ``round_robin``,
``random`` and ``least_load`` differ only in step 3, for comparison):

1. **Decode node** (``_pick_decode``). Only nodes with room count: unreserved KV slots for the
   prompt and the answer's expected length (``need``), and room for the most it may grow to
   (``most``); none has room now: ``NoCapacityError`` (the request waits); none ever could:
   ``ValueError``. Under ``cache_aware`` the node holding the most of the prompt, if at least
   ``cache_threshold`` of it (a conversation's next turn returns to its history); else the one
   with the most unreserved slots.
2. **Alone?** With no prefill pool by choice (``decode_only``: ``pd serve --prefill 0``) the
   decode node prefills every request, warm-ups too; so it does a failover's resumed request
   (``local_only``: its output is prefilled after its prompt). Otherwise, where the caller allows it
   (``allow_local``; conditional disaggregation, off with ``local_prefill_tokens=-1``), it does
   so only if it holds at least as much of the prompt as any prefill node (it never computes
   again what one holds), and either what it would compute is at most ``local_prefill_tokens``,
   or it decodes nothing and holds at least ``local_prefill_min_held`` of the prompt
   (``_is_local``). The choice then names no prefill node.
3. **Prefill node** (``_pick_prefill``). ``cache_aware``: (a) when loads are unbalanced
   (``max - min > balance_abs_tokens`` and ``max > balance_rel * min``; load = prompt tokens
   routed to the node and not yet prefilled), the node expected to get through the prompt
   soonest: its load plus the tokens it would compute, a prefix a pull would bring costing the
   pull's estimated time (``_soonest``); (b) else the node holding the longest prefix, if it
   covers ``cache_threshold`` of the prompt (ties: less loaded, earlier registered); (c) else
   the least loaded (ties: fewest prompts in flight, fewest cached tokens, earliest), so an
   idle cluster does not pin every new prefix to its first node.
4. **Pull?** (``_plan_pull``, off with ``pull_min_tokens=-1``.) When another node, prefill or
   decode, holds at least ``pull_min_tokens`` more of the prompt than the chosen prefill node,
   the choice names that holder (``Choice.pull``) if moving the KV is estimated faster than
   computing it (``pd.router.pulls.plan_pull``; with no pull timed yet, one is tried). The
   decision, either way, rides in the choice for the coordinator to log.
5. **Sooner alone?** (``_is_sooner_local``, with ``local_prefill_balance``.) The decode node
   prefills after all when it decodes nothing and would get through the prompt sooner, by
   more than ``local_prefill_tokens``, than the prefill node (each side's queue plus its part
   of this prompt, after any pull), computing again at most ``local_prefill_tokens`` of what
   the prefill node holds (a shared chat template's opening must not keep a burst off it).
6. Else the decode node and the prefill node (and its pull).

Steps 2 and 5 wait for a decode node that decodes nothing because a long prefill there
stretches every running stream's TPOT (BENCHMARKS.md history, "Trace replay and goodput").
What a node holds, in steps 1-5, is what its cache events say (either tier) plus the prompts
routed to it whose prefill has not finished: one ``SharedPrefixIndex`` over all nodes, so
each step is one walk of the prompt, not one per node.

The choice is made over ``Members``, the coordinator's view of its nodes (``PrefillState``,
``DecodeState``: what is booked on each), and books nothing: ``Coordinator.route`` books it.
Only the round-robin counter and the random policy's generator move here.
"""

from __future__ import annotations

import itertools
import random
from array import array
from dataclasses import dataclass, field
from typing import NamedTuple

from pd.cache.prefix_index import PrefixIndex, PrefixMatch
from pd.core.options import option
from pd.router.pulls import Pull, PullCosts, PullDecision, PullPlan, plan_pull

POLICIES = ("cache_aware", "round_robin", "random", "least_load")


@dataclass(frozen=True)
class CoordinatorConfig:
    """How requests are routed. The ``option`` fields are ``pd serve``'s flags (group
    "routing"), in this order."""

    policy: str = option("cache_aware", None, choices=POLICIES)
    balance_abs_tokens: int = 4096  # loads must differ by more than this many tokens ...
    balance_rel: float = 2.0  # ... and by more than this factor to count as unbalanced
    cache_threshold: float = 0.25  # matched fraction of the prompt that makes a node sticky
    local_prefill_tokens: int = option(
        128,
        "a request is prefilled on its decode node (no KV transfer) when that node would "
        "compute at most this many prompt tokens; -1: never",
    )
    local_prefill_min_held: float = option(
        0.5,
        "... or when the decode node holds at least this fraction of the prompt and no "
        "prefill node holds more (a conversation's next turn)",
    )
    local_prefill_balance: bool = option(
        True,
        "... or when the decode node would get through the prompt sooner than the prefill "
        "node (queued prefills counted)",
    )
    pull_min_tokens: int = option(
        64,
        "pull a prefix's KV from the node holding it when that saves at least this many "
        "tokens and is estimated faster than computing them; -1: never",
    )
    pull_timeout_min_s: float = 1.0  # a pull waits at most max(this, 2x its compute estimate)
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
        if self.local_prefill_tokens < -1:
            raise ValueError(
                f"local_prefill_tokens must be >= 0, or -1 for never; got {self.local_prefill_tokens}"
            )
        if self.pull_min_tokens < -1 or not self.pull_timeout_min_s > 0:
            raise ValueError(
                f"pull_min_tokens must be >= 0, or -1 for never (got {self.pull_min_tokens}); "
                f"pull_timeout_min_s > 0 (got {self.pull_timeout_min_s})"
            )
        if not 0.0 < self.local_prefill_min_held <= 1.0:
            raise ValueError(
                f"local_prefill_min_held must be in (0, 1], got {self.local_prefill_min_held}"
            )


class NoCapacityError(RuntimeError):
    """No decode node has room for the request right now (it may later)."""


class InFlight(NamedTuple):
    """A prompt routed to a node that prefills it (a prefill node, or a decode node alone),
    whose prefill has not finished."""

    key: bytes  # the encoded prompt, counted as pending on the node in the shared index
    namespace: str
    load: int  # uncached prompt tokens it added to the node's load


@dataclass(slots=True)
class PrefillState:
    """A prefill node as the coordinator books it."""

    node_id: str
    index: PrefixIndex
    rank: int  # order of registration: ties go to the earlier node
    load: int = 0  # changed only by Coordinator._add_load
    pos: int = -1  # in Members.accepting, -1 when not there
    inflight: dict[str, InFlight] = field(default_factory=dict)  # request id ->
    draining: bool = False


@dataclass(slots=True)
class DecodeState:
    """A decode node as the coordinator books it."""

    node_id: str
    num_slots: int
    index: PrefixIndex
    reserved: int = 0
    local: dict[str, InFlight] = field(default_factory=dict)  # request -> prefilled here
    local_load: int = 0  # the tokens they compute here, until each one's first token
    started: set[str] = field(default_factory=set)  # requests decoding here (a token came)
    draining: bool = False


class Members(NamedTuple):
    """Derived from the coordinator's node tables; rebuilt when a node is added, drained or
    removed."""

    accepting: list[PrefillState]  # prefill nodes not draining, in registration order
    loads: array[int]  # their loads, kept in step by _add_load: one scan in C per decision
    prefill_bits: int  # their bits in the shared index
    by_bit: dict[int, PrefillState]
    decode: list[DecodeState]  # decode nodes not draining
    prefill: dict[str, PrefillState]  # every prefill node (draining too), by id
    holders: dict[int, str]  # every node's bit in the shared index (prefill and decode) -> id


class Choice(NamedTuple):
    """Where ``RoutePolicy.choose`` sends a request; nothing is booked yet."""

    decode: DecodeState
    prefill: PrefillState | None  # None: the decode node prefills it itself
    num_matched: int  # prompt tokens the node that prefills is expected to hold (pulls too)
    pull: Pull | None = None  # the prefill node first pulls this prefix
    # a pull weighed against computing, to log (also when the decode node then prefills it)
    decision: PullDecision | None = None


class RoutePolicy:
    def __init__(self, cfg: CoordinatorConfig, costs: PullCosts) -> None:
        self.cfg = cfg
        self.costs = costs  # the coordinator's, from the rates the nodes report
        self._rr = itertools.count()
        self._rng = random.Random(cfg.seed)

    def choose(
        self,
        request_id: str,
        members: Members,
        prompt_len: int,
        need: int,
        most: int,
        match: PrefixMatch,
        *,
        allow_local: bool,
        decode_only: bool,
        local_only: bool = False,
    ) -> Choice:
        """The nodes for a request of ``prompt_len`` tokens that books ``need`` KV slots on
        its decode node and may grow to ``most`` (module docstring); ``match``: the prompt in
        the shared index. Raises NoCapacityError if no decode node has room now (or no prefill
        node accepts when one is needed), ValueError if no decode node ever could."""
        decode = self._pick_decode(members, need, most, prompt_len, match)
        held = match.expected_len(decode.index.bit)
        if local_only or (decode_only and not members.accepting):
            # a failover's resumed request, or no prefill pool: the decode nodes prefill every
            # prompt (warm-ups too)
            local = True
        else:
            local = allow_local and self._is_local(members, decode, prompt_len, held, match)
        if local:
            return Choice(decode, None, held)
        node_id, matched = self._pick_prefill(members, prompt_len, match)
        prefill = members.prefill[node_id]
        plan = self._plan_pull(request_id, members, prefill, matched, match)
        if plan.pull is not None:
            matched = plan.pull.num_tokens
        load = prompt_len - matched
        if allow_local and self._is_sooner_local(decode, prompt_len - held, prefill, load):
            return Choice(decode, None, held, None, plan.decision)
        return Choice(decode, prefill, matched, plan.pull, plan.decision)

    def _is_local(
        self, members: Members, decode: DecodeState, prompt_len: int, held: int, match: PrefixMatch
    ) -> bool:
        """Conditional disaggregation's rule (module docstring) for a decode node that holds
        ``held`` tokens of the prompt."""
        if self.cfg.local_prefill_tokens < 0:
            return False
        if held < match.longest_expected(members.prefill_bits)[1]:
            return False  # it would compute again what a prefill node holds
        if prompt_len - held <= self.cfg.local_prefill_tokens:
            return True
        return not decode.started and held >= self.cfg.local_prefill_min_held * prompt_len

    def _plan_pull(
        self,
        request_id: str,
        members: Members,
        node: PrefillState,
        matched: int,
        match: PrefixMatch,
    ) -> PullPlan:
        """A pull for ``node``, expected to hold ``matched`` tokens of the prompt, from the
        node holding the most of it (``plan_pull``)."""
        if self.cfg.pull_min_tokens < 0:
            return PullPlan(None, None)
        others = dict(members.holders)
        del others[node.index.bit]
        mask, num_held = match.longest_held(sum(others))
        return plan_pull(
            request_id,
            node.node_id,
            matched,
            others[mask & -mask] if mask else None,
            num_held,
            self.costs,
            self.cfg.pull_min_tokens,
            self.cfg.pull_timeout_min_s,
        )

    def _is_sooner_local(
        self, decode: DecodeState, num_local: int, prefill: PrefillState, num_remote: int
    ) -> bool:
        """The balance part of the rule: the decode node's queue of local prefills and this
        prompt's part there, against the prefill node's queue and this prompt's part there."""
        if not self.cfg.local_prefill_balance or self.cfg.local_prefill_tokens < 0:
            return False
        margin = self.cfg.local_prefill_tokens
        # never compute again more than a short prefill of what the prefill node holds (or
        # pulls): a shared opening (the chat template's system prompt) may be computed twice
        if decode.started or num_local > num_remote + margin:
            return False
        # sooner by more than a short prefill: a near-tie stays disaggregated
        return decode.local_load + num_local + margin < prefill.load + num_remote

    def _pick_decode(
        self, members: Members, need: int, most: int, prompt_len: int, match: PrefixMatch
    ) -> DecodeState:
        nodes = members.decode
        if not nodes:  # like the prefill side: one may register (or return) later
            raise NoCapacityError("no decode node is accepting requests")
        largest = max(d.num_slots for d in nodes)
        if most > largest:
            raise ValueError(
                f"request needs {most} KV slots; the largest decode node has {largest}"
            )
        fits = [
            (d.num_slots - d.reserved, d.node_id, d)
            for d in nodes
            if d.num_slots - d.reserved >= need and d.num_slots >= most
        ]
        if not fits:
            raise NoCapacityError(f"no decode node has {need} free KV slots right now")
        if self.cfg.policy == "cache_aware":
            # node ids are unique: the states themselves are never compared
            matched, _, _, node = max(
                (match.expected_len(d.index.bit), free, n, d) for free, n, d in fits
            )
            if matched and matched >= self.cfg.cache_threshold * prompt_len:
                return node
        return max(fits)[2]

    def _pick_prefill(
        self, members: Members, prompt_len: int, match: PrefixMatch
    ) -> tuple[str, int]:
        nodes = members.accepting
        if not nodes:
            raise NoCapacityError("no prefill node is accepting requests")
        policy = self.cfg.policy
        if policy == "round_robin":
            node = nodes[next(self._rr) % len(nodes)]
        elif policy == "random":
            node = self._rng.choice(nodes)
        elif policy == "least_load":
            node = self._least_loaded(nodes, members.loads)
        elif self._is_unbalanced(members.loads):
            node = self._soonest(members, prompt_len, match)
        else:
            best, matched = self._longest_match(members, match)
            if best is not None and matched >= self.cfg.cache_threshold * prompt_len:
                return best.node_id, matched
            node = self._least_loaded(nodes, members.loads)
        return node.node_id, match.expected_len(node.index.bit)

    def _soonest(self, members: Members, prompt_len: int, match: PrefixMatch) -> PrefillState:
        """Loads are unbalanced: the node expected to get through the prompt first, weighing
        its queue against the part of the prompt it would compute: the tokens it is expected
        to hold are free, those a pull would bring cost the pull's time in prefill tokens
        (when a pull is estimated to pay). Ties as in ``_least_loaded``."""
        held_mask, num_held = 0, 0
        rate = self.costs.prefill_tokens_per_s
        if self.cfg.pull_min_tokens >= 0 and rate > 0:
            held_mask, num_held = match.longest_held(sum(members.holders))
        best: tuple[float, int, int, int] | None = None
        node = members.accepting[0]
        for p, load in zip(members.accepting, members.loads):
            reach = match.expected_len(p.index.bit)
            cost = float(load + prompt_len - reach)
            gain = num_held - reach
            if held_mask & ~p.index.bit and gain >= max(1, self.cfg.pull_min_tokens):
                est = self.costs.estimate(gain)
                if est is not None and est[0] < est[1]:
                    cost -= gain - est[0] * rate
            key = (cost, load, len(p.inflight), p.index.num_cached_tokens)
            if best is None or key < best:
                best, node = key, p
        return node

    @staticmethod
    def _longest_match(members: Members, match: PrefixMatch) -> tuple[PrefillState | None, int]:
        """The accepting prefill node expected to hold the most of the prompt (the less loaded,
        then the earlier registered, on ties), and how many tokens."""
        mask, num_tokens = match.longest_expected(members.prefill_bits)
        best = None
        while mask:
            low = mask & -mask
            mask ^= low
            node = members.by_bit[low]
            if best is None or (node.load, node.rank) < (best.load, best.rank):
                best = node
        return best, num_tokens

    def _is_unbalanced(self, loads: array[int]) -> bool:
        hi, lo = max(loads), min(loads)
        return hi - lo > self.cfg.balance_abs_tokens and hi > self.cfg.balance_rel * lo

    @staticmethod
    def _least_loaded(nodes: list[PrefillState], loads: array[int]) -> PrefillState:
        """The least loaded of ``nodes``; then the fewest prompts in flight, the fewest cached
        tokens, the earliest registered."""
        lo = min(loads)
        tied = [p for p, load in zip(nodes, loads) if load == lo]
        if len(tied) > 1:
            tied.sort(key=lambda p: (len(p.inflight), p.index.num_cached_tokens))  # stable
        return tied[0]
