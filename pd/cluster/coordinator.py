"""The coordinator: picks a prefill node and a decode node for each request.

Prefill node (policy ``cache_aware``, SGLang's cache-aware routing, with an exact view):

1. Loads are unbalanced when ``max - min > balance_abs_tokens`` and
   ``max > balance_rel * min`` (load = prompt tokens routed to the node and not yet
   prefilled): go to the node expected to get through the prompt soonest, weighing its load
   against the prompt tokens it would compute: those it is expected to hold are free, those a
   pull would bring from any node cost the pull's estimated time in prefill tokens (so the
   holder keeps a request while its queue is shorter than the prefix it would save); ties go
   to the least loaded. A cold prompt goes to the least-loaded node.
2. Else go to the node holding the longest prefix of the prompt, if it covers at least
   ``cache_threshold`` of the prompt. What a node holds is replayed from its cache events
   (``PrefixIndex``), plus the prompts routed to it whose prefill has not finished yet (they
   will be in its cache by the time a follower is admitted there). Both live in one
   ``SharedPrefixIndex`` over all nodes, so this is one walk of the prompt, not one per node.
3. Else the least-loaded node. Ties (e.g. all idle) go to the node caching the fewest
   tokens: otherwise an idle cluster would pin every new prefix to the same first node.

``round_robin``, ``random`` and ``least_load`` are there for comparison.
Decode node, among those with enough unreserved KV slots for prompt + max_tokens: under
``cache_aware``, the one whose own cache (decode nodes keep what they decoded, mirrored from
their events too) holds at least ``cache_threshold`` of the prompt, longest first, so a
conversation's next turn returns to the node that has its history and less KV moves; else,
and under the other policies, the one with the most unreserved slots.

Conditional disaggregation (any policy, off with ``local_prefill_tokens=-1``): the request goes
to the chosen decode node alone (``Route.prefill`` is None), which prefills it itself, provided
it holds at least as much of the prompt as any prefill node is expected to (it never computes
again what a prefill node holds: that would lower the hit rate and strand a second copy), when
what that node would have to compute is short (prompt tokens beyond the prefix it holds <=
``local_prefill_tokens``), or when it holds at least ``local_prefill_min_held`` of the prompt
(the next turn of a conversation), or, with ``local_prefill_balance``, when the prefill side is
busy enough that the decode node would get through the prompt sooner: the tokens it would
compute plus those of the local prefills it has queued are fewer, by more than
``local_prefill_tokens``, than the chosen prefill node's (its queue plus its part of this
prompt, after any pull), so a burst of cold prompts is prefilled on both sides at
once. Balance computes again at most ``local_prefill_tokens`` of what the prefill node holds:
cold chat prompts share their template's opening (a system prompt), which alone must not keep
a burst off the idle decode node. The last two apply only while the
decode node decodes nothing: a long prefill there would stretch every running stream's TPOT
(measured: 1.9 s instead of 0.19 s per token on a replayed trace), a short one barely does. Either way no KV moves and no second
hop is paid; decode nodes prefill in chunks between their decode steps.
A cluster whose prefill pool is empty by choice (``decode_only``, ``pd serve --prefill 0``: the
default on one CPU machine) routes every request so, warm-ups included, whatever these rules
and ``local_prefill_tokens=-1`` say: its decode nodes are then aggregated engines behind
cache-aware routing, and a prefill node added later takes prompts again as above.
What a decode node holds is, as for a prefill node, what its cache events say plus the prompts it
is prefilling itself (a follower admitted there waits for them, as on a prefill node); a prompt
whose KV it is receiving counts only once its events say so.
Pulls (off with ``pull_min_tokens=-1``): when the chosen prefill node is expected to hold less
of the prompt than another node (prefill or decode, in any tier its events announce) holds, by at
least ``pull_min_tokens``, the route names that holder (``Route.pull``) if moving the missing
tokens' KV is estimated faster than computing them: ``PullCosts`` from what the nodes measured
(prefill tokens per second in pure prefill batches; bytes per second of finished pulls), none
before the prefill rate is measured; until a pull has been measured, one is tried. Each such choice, either way, goes
into ``decisions`` with both estimates (the node reports the pull's real time, ``PullLog``). So
a prefix is never stranded where it was computed (a conversation prefilled on its decode node,
a node that load sent elsewhere), and load balancing costs a pull instead of a recompute.
A node whose cache events were lost (a seq gap) is listed in ``nodes_to_resync``, answered from
its last consistent view, until its ``take_snapshot()`` arrives (``apply_snapshot``, or the reset
event in its stream). All of this is plain Python: the cluster client feeds it events and request
life-cycle calls.
"""

from __future__ import annotations

import itertools
import random
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pd.cache.holder_tree import TOKEN_BYTES, encode_tokens
from pd.cache.prefix_index import PrefixIndex, PrefixMatch, SharedPrefixIndex
from pd.cluster.route_log import RouteLog
from pd.core.messages import CacheEventMsg, NodeStatsMsg, PullDoneMsg

POLICIES = ("cache_aware", "round_robin", "random", "least_load")


@dataclass(frozen=True)
class CoordinatorConfig:
    policy: str = "cache_aware"
    balance_abs_tokens: int = 4096  # loads must differ by more than this many tokens ...
    balance_rel: float = 2.0  # ... and by more than this factor to count as unbalanced
    cache_threshold: float = 0.25  # matched fraction of the prompt that makes a node sticky
    # prefill on the decode node when it would compute at most this many tokens (-1: never)
    local_prefill_tokens: int = 128
    # ... or when it holds at least this fraction of the prompt, as much as any prefill node
    local_prefill_min_held: float = 0.5
    # ... or when the decode node would get through its prefill sooner than the prefill side
    local_prefill_balance: bool = True
    # pull a prefix another node holds when it saves at least this many tokens (-1: never)
    pull_min_tokens: int = 64
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


class Pull(NamedTuple):
    holder: str  # the node to pull from
    num_tokens: int  # the prompt's first tokens, all held there
    timeout_s: float  # past this the prefill node computes them instead


class Route(NamedTuple):
    prefill: str | None  # None: the decode node prefills the request itself
    decode: str
    num_matched: int  # prompt tokens the node that prefills is expected to hold (pulls too)
    pull: Pull | None = None  # the prefill node first pulls this prefix


@dataclass
class PullCosts:
    """What a pull is weighed against, from the nodes' latest stats (``update``)."""

    kv_bytes_per_token: int = 0
    prefill_tokens_per_s: float = 0.0  # 0: not measured yet
    bytes_per_s: float = 0.0
    pulls_measured: bool = False  # bytes_per_s comes from pulls (else from transfers)

    def update(self, stats: Iterable[NodeStatsMsg], kv_bytes_per_token: int) -> None:
        """Cluster-wide rates: prompt tokens computed per second in pure prefill batches, and
        bytes moved per second by pulls, or, before any pull came, by prefill-to-decode
        transfers over the part of their time not hidden behind the forward (a first guess:
        until a pull is measured, the coordinator tries one whatever it says)."""
        tokens = seconds = pulled = pull_s = sent = send_s = 0.0
        for s in stats:
            tokens, seconds = tokens + s.num_prefill_tokens, seconds + s.prefill_seconds
            pulled, pull_s = pulled + s.pull_bytes, pull_s + s.pull_seconds
            sent, send_s = sent + s.transfer_bytes, send_s + s.transfer_wire_seconds
        self.kv_bytes_per_token = kv_bytes_per_token
        self.prefill_tokens_per_s = tokens / seconds if seconds > 0 else 0.0
        self.bytes_per_s = pulled / pull_s if pull_s > 0 else sent / send_s if send_s > 0 else 0.0
        self.pulls_measured = pull_s > 0

    def estimate(self, num_tokens: int) -> tuple[float, float] | None:
        """(seconds to pull, seconds to compute) ``num_tokens``; None before both rates are
        measured."""
        if not (self.prefill_tokens_per_s > 0 and self.bytes_per_s > 0 and self.kv_bytes_per_token):
            return None
        pull_s = num_tokens * self.kv_bytes_per_token / self.bytes_per_s
        return pull_s, num_tokens / self.prefill_tokens_per_s


@dataclass
class PullDecision:
    """One choice between pulling a prefix and computing it, and (once the node reported it)
    how the pull went."""

    request_id: str  # the wire id
    node: str  # the prefill node
    holder: str
    num_tokens: int  # tokens the pull would save
    est_pull_s: float
    est_compute_s: float
    choice: str  # "pull" | "compute"
    pull_s: float | None = None  # measured: arrival to the prefix in the cache, or to fallback
    num_pulled: int | None = None
    error: str | None = None  # why a pull fell back to computing


class PullLog:
    """The last ``maxlen`` decisions, and counts since start."""

    def __init__(self, maxlen: int = 256) -> None:
        self.decisions: deque[PullDecision] = deque(maxlen=maxlen)
        self._open: dict[str, PullDecision] = {}  # pulls not reported yet, by wire id
        self.num_pulls = 0  # chosen
        self.num_computed = 0  # a holder had more, but computing was estimated faster
        self.num_fallbacks = 0  # chosen, but computed after all (refused, gone, timed out)
        self.num_pulled_tokens = 0
        self.pull_seconds = 0.0  # of the pulls that came

    def add(self, d: PullDecision) -> None:
        self.decisions.append(d)
        if d.choice == "pull":
            self.num_pulls += 1
            self._open[d.request_id] = d
            if len(self._open) > 4 * (self.decisions.maxlen or 1):  # unreported: lost nodes
                self._open.pop(next(iter(self._open)))
        else:
            self.num_computed += 1

    def done(self, msg: PullDoneMsg) -> None:
        d = self._open.pop(msg.request_id, None)
        if msg.error is None:
            self.num_pulled_tokens += msg.num_pulled
            self.pull_seconds += msg.seconds
        else:
            self.num_fallbacks += 1
        if d is not None:
            d.pull_s, d.num_pulled, d.error = msg.seconds, msg.num_pulled, msg.error

    def forget(self, request_id: str) -> None:
        self._open.pop(request_id, None)


class NoCapacityError(RuntimeError):
    """No decode node has room for the request right now (it may later)."""


class _InFlight(NamedTuple):
    """A prompt routed to a node that prefills it (a prefill node, or a decode node alone),
    whose prefill has not finished."""

    key: bytes  # the encoded prompt, counted as pending on the node in the shared index
    namespace: str
    load: int  # uncached prompt tokens it added to the node's load


@dataclass(slots=True)
class _Prefill:
    node_id: str
    index: PrefixIndex
    rank: int  # order of registration: ties go to the earlier node
    load: int = 0  # changed only by Coordinator._add_load
    pos: int = -1  # in _Members.accepting, -1 when not there
    inflight: dict[str, _InFlight] = field(default_factory=dict)  # request id ->
    draining: bool = False


@dataclass(slots=True)
class _Decode:
    node_id: str
    num_slots: int
    index: PrefixIndex
    reserved: int = 0
    local: dict[str, _InFlight] = field(default_factory=dict)  # request -> prefilled here
    local_load: int = 0  # the tokens they compute here, until each one's first token
    started: set[str] = field(default_factory=set)  # requests decoding here (a token came)
    draining: bool = False


class _Booking(NamedTuple):
    """What ``route`` booked for a request, released by ``on_prefilled``/``on_finished``. The
    nodes' states, not their ids: a node removed and registered again is a new state."""

    prefill: _Prefill | None  # None: prefilled on the decode node
    decode: _Decode
    num_reserved_slots: int  # on the decode node


class _Members(NamedTuple):
    """Derived from the node tables; rebuilt when a node is added, drained or removed."""

    accepting: list[_Prefill]  # prefill nodes not draining, in registration order
    loads: array[int]  # their loads, kept in step by _add_load: one scan in C per decision
    prefill_bits: int  # their bits in the shared index
    by_bit: dict[int, _Prefill]
    decode: list[tuple[str, _Decode]]  # decode nodes not draining


class Coordinator:
    def __init__(self, cfg: CoordinatorConfig) -> None:
        self.cfg = cfg
        self._mirror = SharedPrefixIndex(cfg.page_size)  # every node's cache, prefill and decode
        self._prefill: dict[str, _Prefill] = {}
        self._decode: dict[str, _Decode] = {}
        self._requests: dict[str, _Booking] = {}
        self._rr = itertools.count()
        self._ranks = itertools.count()
        self._rng = random.Random(cfg.seed)
        self._members: _Members | None = None  # rebuilt after membership changes
        self.num_local_routes = 0  # requests sent to a decode node alone
        # Set by the launcher while the prefill pool has no node and waits for no replacement
        # (its target is 0, or its first node starts): with no prefill node accepting, every
        # request is prefilled on its decode node. Otherwise a request waits
        # (NoCapacityError) while the prefill pool has no node, e.g. for a replacement.
        self.decode_only = False
        self.costs = PullCosts()
        self.pulls = PullLog()
        self.routes = RouteLog()  # where each recent attempt went (GET /admin/routes)

    # -- membership -------------------------------------------------------------------------

    def add_prefill(self, node_id: str) -> None:
        self.remove(node_id)  # a node that registers again starts from nothing
        self._prefill[node_id] = _Prefill(node_id, self._mirror.add(node_id), next(self._ranks))

    def add_decode(self, node_id: str, num_slots: int) -> None:
        self.remove(node_id)
        self._decode[node_id] = _Decode(node_id, num_slots, self._mirror.add(node_id))

    def drain(self, node_id: str) -> None:
        """Send no new requests to this node."""
        (self._prefill.get(node_id) or self._decode[node_id]).draining = True
        self._members = None

    def remove(self, node_id: str) -> None:
        self._members = None
        node = self._prefill.pop(node_id, None)
        if node is not None:
            node.pos = -1  # its requests may still finish: their loads go nowhere
        self._decode.pop(node_id, None)
        self._mirror.remove(node_id)

    @property
    def prefill_nodes(self) -> list[str]:
        return list(self._prefill)

    @property
    def decode_nodes(self) -> list[str]:
        return list(self._decode)

    def index(self, node_id: str) -> PrefixIndex:
        """The mirror of a (prefill or decode) node's cache."""
        return self._mirror.index(node_id)

    def load(self, node_id: str) -> int:
        return self._prefill[node_id].load

    # -- events, snapshots and life cycle ---------------------------------------------------

    def apply_event(self, event: CacheEventMsg) -> None:
        self._mirror.apply(event)

    @property
    def nodes_to_resync(self) -> list[str]:
        """Nodes whose mirror missed cache events: ask each for ``take_snapshot()`` and hand it
        to ``apply_snapshot`` (or let its reset arrive in the event stream)."""
        return self._mirror.nodes_to_resync

    def apply_snapshot(self, node_id: str, events: Sequence[CacheEventMsg]) -> None:
        """Rebuild a node's mirror from its ``take_snapshot()``; a node gone since is ignored.
        Events the node published after the snapshot still apply after it, in seq order."""
        if node_id in self._mirror:
            self._mirror.index(node_id).apply_snapshot(events)

    def route(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        max_tokens: int,
        namespace: str = "",
        *,
        allow_local: bool = True,
    ) -> Route:
        """Pick both nodes (or the decode node alone: conditional disaggregation, unless not
        ``allow_local``) and book the request on them; raises NoCapacityError if no decode node
        has room now, ValueError if none ever could. Routing a request that is still booked
        releases its booking first."""
        if request_id in self._requests:
            self.on_finished(request_id)
        page = self.cfg.page_size
        need = -(-(len(prompt_ids) + max_tokens) // page) * page  # decode nodes take whole pages
        key = encode_tokens(prompt_ids)
        # The last prompt token is always computed (see BasePrefixCache.match_prompt).
        members = self._membership()
        match = self._mirror.match(key[:-TOKEN_BYTES], namespace)
        decode = self._pick_decode(members, need, len(prompt_ids), match)
        decode_node = self._decode[decode]
        held = match.expected_len(decode_node.index.bit)
        if self.decode_only and not members.accepting:
            local = True  # no prefill pool: the decode nodes prefill every prompt (warm-ups too)
        else:
            local = allow_local and self._is_local(
                members, decode_node, len(prompt_ids), held, match
            )
        pull = None
        if not local:
            prefill, matched = self._pick_prefill(members, len(prompt_ids), match)
            node = self._prefill[prefill]
            pull = self._plan_pull(request_id, node, matched, match)
            matched = pull.num_tokens if pull is not None else matched
            load = len(prompt_ids) - matched
            local = allow_local and self._is_sooner_local(
                decode_node, len(prompt_ids) - held, node, load
            )
        if local:
            self.num_local_routes += 1
            decode_node.reserved += need
            decode_node.local[request_id] = _InFlight(key, namespace, len(prompt_ids) - held)
            decode_node.local_load += len(prompt_ids) - held
            self._mirror.add_pending(decode, key, namespace, after=match)
            self._requests[request_id] = _Booking(None, decode_node, need)
            chosen = Route(None, decode, held)
        else:
            self._add_load(node, load)
            node.inflight[request_id] = _InFlight(key, namespace, load)
            self._mirror.add_pending(prefill, key, namespace, after=match)
            decode_node.reserved += need
            self._requests[request_id] = _Booking(node, decode_node, need)
            chosen = Route(prefill, decode, matched, pull)
        self.routes.add(request_id, chosen)
        return chosen

    def on_prefilled(self, request_id: str) -> None:
        """The request's first token came: its prefill load is gone, and its decode node is
        decoding it."""
        booking = self._requests.get(request_id)
        if booking is None:
            return
        booking.decode.started.add(request_id)
        node = booking.prefill
        if node is None:
            decode = booking.decode
            local = decode.local.pop(request_id, None)
            if local is not None:
                decode.local_load -= local.load
                if self._decode.get(decode.node_id) is decode:
                    self._mirror.remove_pending(decode.node_id, local.key, local.namespace)
            return
        inflight = node.inflight.pop(request_id, None)
        if inflight is not None:
            self._add_load(node, -inflight.load)
            if self._prefill.get(node.node_id) is node:  # a removed node took its prompts along
                self._mirror.remove_pending(node.node_id, inflight.key, inflight.namespace)

    def on_finished(self, request_id: str) -> None:
        self.on_prefilled(request_id)
        booking = self._requests.pop(request_id, None)
        if booking is not None:
            booking.decode.reserved -= booking.num_reserved_slots
            booking.decode.started.discard(request_id)

    def check_integrity(self) -> None:
        """Loads and reservations are the sums of what is booked; the mirror's pending prompts
        are exactly the prompts in flight."""
        if self._members is not None:
            assert [p.load for p in self._members.accepting] == list(self._members.loads)
        for node_id, node in self._prefill.items():
            assert node.load == sum(f.load for f in node.inflight.values()), (
                f"{node_id} load {node.load}, in flight {[f.load for f in node.inflight.values()]}"
            )
            assert all(self._requests[r].prefill is node for r in node.inflight)
        for node_id, decode in self._decode.items():
            booked = sum(
                b.num_reserved_slots for b in self._requests.values() if b.decode is decode
            )
            assert decode.reserved == booked, (
                f"{node_id} reserved {decode.reserved}, booked {booked}"
            )
            assert decode.local_load == sum(f.load for f in decode.local.values()), node_id
            assert all(self._requests[r].decode is decode for r in decode.local)
            assert all(self._requests[r].decode is decode for r in decode.started)
        self._mirror.check_integrity(
            (node_id, f.key, f.namespace)
            for node_id, flights in itertools.chain(
                ((n, p.inflight) for n, p in self._prefill.items()),
                ((n, d.local) for n, d in self._decode.items()),
            )
            for f in flights.values()
        )

    # -- choices ----------------------------------------------------------------------------

    def _is_local(
        self, members: _Members, decode: _Decode, prompt_len: int, held: int, match: PrefixMatch
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
        self, request_id: str, node: _Prefill, matched: int, match: PrefixMatch
    ) -> Pull | None:
        """A pull for ``node``, expected to hold ``matched`` tokens of the prompt, from the
        node holding the most of it, if that saves at least ``pull_min_tokens`` and is
        estimated faster than computing them (logged either way)."""
        if self.cfg.pull_min_tokens < 0:
            return None
        holders = self._holders()
        del holders[node.index.bit]
        mask, num_held = match.longest_held(sum(holders))
        gain = num_held - matched
        if not mask or gain < max(1, self.cfg.pull_min_tokens):
            return None
        est = self.costs.estimate(gain)
        if est is None:
            return None
        pull_s, compute_s = est
        holder = holders[mask & -mask]
        # Until a pull has been measured, one is tried whatever the transfers' rate says: a
        # transfer's time counts its wait for room on a busy decode node, a pull's does not.
        pays = pull_s < compute_s or not self.costs.pulls_measured
        choice = "pull" if pays else "compute"
        self.pulls.add(
            PullDecision(request_id, node.node_id, holder, gain, pull_s, compute_s, choice)
        )
        if choice == "compute":
            return None
        return Pull(holder, num_held, max(self.cfg.pull_timeout_min_s, 2 * compute_s))

    def _is_sooner_local(
        self, decode: _Decode, num_local: int, prefill: _Prefill, num_remote: int
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
        self, members: _Members, need: int, prompt_len: int, match: PrefixMatch
    ) -> str:
        nodes = members.decode
        if not nodes:  # like the prefill side: one may register (or return) later
            raise NoCapacityError("no decode node is accepting requests")
        fits = [
            (d.num_slots - d.reserved, n, d.index.bit)
            for n, d in nodes
            if d.num_slots - d.reserved >= need
        ]
        if not fits:
            most = max(d.num_slots for _, d in nodes)
            if need > most:
                raise ValueError(
                    f"request needs {need} KV slots; the largest decode node has {most}"
                )
            raise NoCapacityError(f"no decode node has {need} free KV slots right now")
        if self.cfg.policy == "cache_aware":
            matched, _, node = max((match.expected_len(bit), free, n) for free, n, bit in fits)
            if matched and matched >= self.cfg.cache_threshold * prompt_len:
                return node
        return max(fits)[1]

    def _pick_prefill(
        self, members: _Members, prompt_len: int, match: PrefixMatch
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

    def _soonest(self, members: _Members, prompt_len: int, match: PrefixMatch) -> _Prefill:
        """Loads are unbalanced: the node expected to get through the prompt first, weighing
        its queue against the part of the prompt it would compute: the tokens it is expected
        to hold are free, those a pull would bring cost the pull's time in prefill tokens
        (when a pull is estimated to pay). Ties as in ``_least_loaded``."""
        held_mask, num_held = 0, 0
        rate = self.costs.prefill_tokens_per_s
        if self.cfg.pull_min_tokens >= 0 and rate > 0:
            held_mask, num_held = match.longest_held(sum(self._holders()))
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

    def _holders(self) -> dict[int, str]:
        """Every node's bit in the shared index (prefill and decode) -> its id."""
        holders = {p.index.bit: n for n, p in self._prefill.items()}
        holders.update((d.index.bit, n) for n, d in self._decode.items())
        return holders

    @staticmethod
    def _longest_match(members: _Members, match: PrefixMatch) -> tuple[_Prefill | None, int]:
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

    def _add_load(self, node: _Prefill, delta: int) -> None:
        node.load += delta
        if node.pos >= 0 and self._members is not None:
            self._members.loads[node.pos] += delta

    def _membership(self) -> _Members:
        if self._members is None:
            accepting = [p for p in self._prefill.values() if not p.draining]
            for node in self._prefill.values():
                node.pos = -1
            for pos, node in enumerate(accepting):
                node.pos = pos
            self._members = _Members(
                accepting,
                array("q", [p.load for p in accepting]),
                sum(p.index.bit for p in accepting),
                {p.index.bit: p for p in accepting},
                [(n, d) for n, d in self._decode.items() if not d.draining],
            )
        return self._members

    def _is_unbalanced(self, loads: array[int]) -> bool:
        hi, lo = max(loads), min(loads)
        return hi - lo > self.cfg.balance_abs_tokens and hi > self.cfg.balance_rel * lo

    @staticmethod
    def _least_loaded(nodes: list[_Prefill], loads: array[int]) -> _Prefill:
        """The least loaded of ``nodes``; then the fewest prompts in flight, the fewest cached
        tokens, the earliest registered."""
        lo = min(loads)
        tied = [p for p, load in zip(nodes, loads) if load == lo]
        if len(tied) > 1:
            tied.sort(key=lambda p: (len(p.inflight), p.index.num_cached_tokens))  # stable
        return tied[0]
