"""Judging the soak's requests: each request's verdict (``judge``) and their tally by source.

A request is *ok* (the reference answer, to the token), *expected* (an error a fault explains:
a stream cut on a node the soak killed, a 429 while admission was pressed, a 408 to a slow
body, a stalled stream cut by the server, a 503 while the server said it was not ready),
*wrong* (any other answer, or a partial answer that is not a prefix of the reference), a
*hang* (no end within the client's deadline) or *unexpected* (any other error).
"""

from __future__ import annotations

import re
import statistics
from collections import Counter, defaultdict
from typing import NamedTuple

from pdtools.chaos_cluster import Interval
from pdtools.chaos_load import Answer, Outcome

NODE_FAILED = re.compile(r"node ([\w.-]+) failed")
_CUT_CODES = ("", "request_timeout")  # how a server may end a stream whose client stopped reading


class Verdict(NamedTuple):
    category: str  # ok | expected | wrong | hang | unexpected
    kind: str  # why (for expected and unexpected: counted by kind)
    is_5xx: bool = False


class Context(NamedTuple):
    """What explains errors: nodes meant to die (-> when), windows of admission pressure,
    intervals in which the server said it was not ready."""

    doomed: dict[str, float]
    pressure: list[tuple[float, float]]
    not_ready: list[Interval]


def _overlaps(out: Outcome, windows: list[tuple[float, float]]) -> bool:
    return any(start <= out.end and out.start <= end for start, end in windows)


def judge(out: Outcome, ref: Answer, ctx: Context) -> Verdict:
    if out.hang:
        return Verdict("hang", out.error)
    if out.status == 200 and out.answer is not None:
        if out.complete:
            why = out.answer.differs_from(ref)
            return Verdict("ok", "") if why is None else Verdict("wrong", why)
        if not out.answer.is_prefix_of(ref):
            return Verdict("wrong", f"cut short, and what came differs: {out.answer.text[:60]!r}")
    failed = NODE_FAILED.search(out.error)
    if failed and ctx.doomed.get(failed[1], float("inf")) <= out.end:
        return Verdict("expected", "its node was killed or frozen")
    if out.status == 200:  # a stream cut short, no node to blame
        if out.source == "stalled" and out.code in _CUT_CODES:  # its deadline, or its writes
            return Verdict("expected", f"stalled stream cut ({out.code or 'connection closed'})")
        return Verdict("unexpected", f"stream ended early: {out.code or out.error[:80]}", True)
    if out.status == 429 and (out.source != "steady" or _overlaps(out, ctx.pressure)):
        return Verdict("expected", "429 while admission was pressed")
    if out.status == 408 and out.source == "slow_body":
        return Verdict("expected", "408: body too slow")
    if out.status == 503 and _overlaps(out, [(i.start, i.end) for i in ctx.not_ready]):
        return Verdict("expected", "503 while not ready")
    if out.status is None and out.source in ("stalled", "slow_body"):
        return Verdict("expected", f"connection closed by the server ({out.source})")
    what = f"{out.status} {out.code or out.error[:80]}" if out.status else out.error[:100]
    return Verdict("unexpected", what, out.status is not None and out.status >= 500)


class Tally:
    """Verdicts by source, with examples of what failed."""

    def __init__(self) -> None:
        self.counts: dict[str, Counter[str]] = defaultdict(Counter)
        self.expected: dict[str, Counter[str]] = defaultdict(Counter)
        self.unexpected: Counter[str] = Counter()
        self.examples: list[str] = []  # wrong answers and hangs, the first few
        self.num_5xx = 0
        self.latencies: list[tuple[float, float]] = []  # steady ok requests: (start, seconds)

    def add(self, out: Outcome, verdict: Verdict) -> None:
        self.counts[out.source][verdict.category] += 1
        self.counts[out.source]["sent"] += 1
        if verdict.category == "expected":
            self.expected[out.source][verdict.kind] += 1
        elif verdict.category == "unexpected":
            self.unexpected[verdict.kind] += 1
            self.num_5xx += verdict.is_5xx
        elif verdict.category in ("wrong", "hang") and len(self.examples) < 10:
            self.examples.append(f"{verdict.category}: {out.source} {out.spec}: {verdict.kind}")
        if verdict.category == "ok" and out.source == "steady":
            self.latencies.append((out.start, out.latency))

    def total(self, category: str) -> int:
        return sum(c[category] for c in self.counts.values())

    def latency_in(self, start: float, end: float) -> str:
        """Median and longest latency of the steady requests that started in [start, end]."""
        got = [lat for t, lat in self.latencies if start <= t <= end]
        return f"{statistics.median(got):.2f} / {max(got):.1f} s ({len(got)})" if got else "-"
