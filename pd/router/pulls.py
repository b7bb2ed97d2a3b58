"""Pull costing: whether a prefill node should pull a prefix another node holds, or compute it.

``PullCosts`` keeps the rates a pull is weighed with, from the nodes' latest stats (prefill
tokens per second in pure prefill batches; bytes per second of finished pulls, or before any,
of prefill-to-decode transfers). ``plan_pull`` makes one choice from them: pull the prompt's
first ``num_held`` tokens from the node holding the most of it when that saves at least
``min_tokens`` and is estimated faster than computing them (or no pull has been timed yet:
then one is tried). Each choice, either way, goes into a ``PullLog`` with both estimates, and
the node's report of the pull (``PullDoneMsg``) completes it with the time it took. All plain
Python: the coordinator calls it while choosing a route and logs the choice when it books.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from pd.core.messages import NodeStatsMsg, PullDoneMsg


class Pull(NamedTuple):
    holder: str  # the node to pull from
    num_tokens: int  # the prompt's first tokens, all held there
    timeout_s: float  # past this the prefill node computes them instead


@dataclass
class PullCosts:
    """What a pull is weighed against, from the nodes' latest stats (``update``)."""

    kv_bytes_per_token: int = 0
    prefill_tokens_per_s: float = 0.0  # 0: no sample yet
    bytes_per_s: float = 0.0
    pulls_measured: bool = False  # bytes_per_s comes from pulls (else from transfers)

    def update(self, stats: Iterable[NodeStatsMsg], kv_bytes_per_token: int) -> None:
        """Cluster-wide rates: prompt tokens computed per second in pure prefill batches, and
        bytes moved per second by pulls, or, before any pull came, by prefill-to-decode
        transfers over the part of their time not hidden behind the forward (a first guess:
        until a pull is timed, the coordinator tries one whatever it says)."""
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
        known."""
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
    pull_s: float | None = None  # taken: arrival to the prefix in the cache, or to fallback
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


class PullPlan(NamedTuple):
    pull: Pull | None  # None: the node computes the prompt beyond what it holds
    decision: PullDecision | None  # to log (None: there was nothing to weigh)


def plan_pull(
    request_id: str,
    node: str,
    num_matched: int,
    holder: str | None,
    num_held: int,
    costs: PullCosts,
    min_tokens: int,
    timeout_min_s: float,
) -> PullPlan:
    """For the prefill node ``node``, expected to hold ``num_matched`` tokens of the prompt:
    a pull of the ``num_held`` tokens ``holder`` holds (the most any other node does), if that
    saves at least ``min_tokens`` and is estimated faster than computing them. The decision
    comes back either way, for the log; none when nothing was weighed (no holder, too few
    tokens, rates not known yet)."""
    gain = num_held - num_matched
    if holder is None or gain < max(1, min_tokens):
        return PullPlan(None, None)
    est = costs.estimate(gain)
    if est is None:
        return PullPlan(None, None)
    pull_s, compute_s = est
    # Until a pull has been timed, one is tried whatever the transfers' rate says: a
    # transfer's time counts its wait for room on a busy decode node, a pull's does not.
    pays = pull_s < compute_s or not costs.pulls_measured
    choice = "pull" if pays else "compute"
    decision = PullDecision(request_id, node, holder, gain, pull_s, compute_s, choice)
    if not pays:
        return PullPlan(None, decision)
    return PullPlan(Pull(holder, num_held, max(timeout_min_s, 2 * compute_s)), decision)
