"""The soak's report: each request's verdict (``pdtools.chaos_judge``) tallied, the leak
checks after the quiet period (``leak_checks``), what the soak saw of nodes, readiness and
memory, and the report (a markdown table for RELIABILITY.md, and JSON).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple

from pdtools.chaos_cluster import ROLES, Metrics, Monitor, Pools
from pdtools.chaos_faults import Chaos, FaultRecord
from pdtools.chaos_judge import Context, Tally, judge
from pdtools.chaos_lanes import sources
from pdtools.chaos_load import Outcome, References

MAX_UNEXPECTED_FRACTION = 0.001  # the acceptance bound: unexpected errors <= 0.1% of requests
SOURCES = {"steady": "steady load", **sources()}  # the requests' sources, as the report names them


class Check(NamedTuple):
    name: str
    measured: str
    bound: str
    ok: bool


def leak_checks(
    pools: Pools, metrics: Metrics, sizes: dict[str, int], idle_threads: dict[str, int]
) -> list[Check]:
    """What must be back at its idle level once the load has stopped."""
    nodes = pools.nodes
    # a pair group per direction per live peer at most: KV goes prefill -> decode, and a pull
    # between any two nodes; a push socket and a transfer dealer per peer sent to
    peers = len(nodes) - 1
    over_pairs = [f"{n['id']}: {n['pair_groups']}" for n in nodes if n["pair_groups"] > 2 * peers]
    over_sockets = [f"{n['id']}: {n['sockets']}" for n in nodes if n["sockets"] > 3 + 2 * peers]
    over_threads = [
        f"{n['id']}: {n['threads']} with {n['pair_groups']} pairs"
        for n in nodes
        if n["threads"] - 2 * n["pair_groups"] > idle_threads.get(n["role"], 0)
    ]
    sizes_now = ", ".join(f"{len(pools.of(r))}/{sizes[r]} {r}" for r in ROLES)
    place = {
        name: metrics.value(name)
        for name in (
            "pd_server_admitted_requests",
            "pd_server_queued_requests",
            "pd_server_running_requests",
            "pd_coordinator_queue_depth",
        )
    }
    return [
        Check("pools whole (ready nodes / size, none starting or draining)", sizes_now, "all", pools.is_whole(sizes)),
        Check("KV slots held by requests (all nodes)", str(sum(n["slots_in_use"] for n in nodes)), "0", all(n["slots_in_use"] == 0 for n in nodes)),
        Check("requests and queued tokens on nodes", str(sum(n["load"] + n["queued_tokens"] for n in nodes)), "0", all(n["load"] == n["queued_tokens"] == 0 for n in nodes)),
        Check("pair groups per node", ", ".join(over_pairs) or f"max {max((n['pair_groups'] for n in nodes), default=0)}", "<= 2 per peer (each way)", not over_pairs),
        Check("zmq sockets per node", ", ".join(over_sockets) or f"max {max((n['sockets'] for n in nodes), default=0)}", "<= 3 + 2 per peer", not over_sockets),
        Check("threads per node beyond 2 per pair group", ", ".join(over_threads) or "at idle level", f"<= idle ({idle_threads})", not over_threads),
        Check("pending KV transfers", f"{metrics.total('pd_node_pending_transfers'):.0f}", "0", metrics.total("pd_node_pending_transfers") == 0),
        Check("admission places held, queued; server and coordinator in flight", ", ".join(f"{v:.0f}" for v in place.values()), "0, 0, 0, 0", not any(place.values())),
    ]  # fmt: skip


def render(summary: dict[str, Any]) -> str:
    """The report, in markdown."""
    s = summary
    lines = [
        f"### Chaos soak: {s['minutes']:g} min, seed {s['seed']}, {s['cluster']}, model {s['model']}"
        + (f", engine `{s['engine']}`" if s.get("engine") else ""),
        "",
        f"Result: **{'PASS' if not s['failures'] else 'FAIL'}** — {s['counts']['total']} requests, "
        f"{s['counts']['wrong']} wrong answers, {s['counts']['hangs']} hangs, "
        f"{s['counts']['unexpected']} unexpected errors ({s['counts']['unexpected_pct']:.3f}%, "
        f"bound {100 * MAX_UNEXPECTED_FRACTION:g}%; {s['counts']['unexpected_5xx']} of them 5xx). "
        f"Steady load: p50 {s['latency']['p50']} s, p99 {s['latency']['p99']} s.",
        "",
        "Over the soak: "
        + ", ".join(f"{_COUNTER_NAMES[k]} {v:.0f}" for k, v in s["metric_deltas"].items())
        + ".",
        "",
        f"Requests without `max_tokens` (the server's default: the rest of the context for "
        f"chat, 16 tokens for completions): {s['no_max_tokens']['sent']} sent, "
        f"{s['no_max_tokens'].get('ok', 0)} correct.",
        "",
        "| requests | sent | correct | expected errors (why) | wrong | hangs | unexpected |",
        "|---|---|---|---|---|---|---|",
    ]
    for source, row in s["requests"].items():
        why = "; ".join(f"{k}: {v}" for k, v in row["expected_kinds"].items())
        lines.append(
            f"| {SOURCES.get(source, source)} | {row['sent']} | {row['ok']} | {row['expected']}"
            f"{f' ({why})' if why else ''} | {row['wrong']} | {row['hang']} | {row['unexpected']} |"
        )
    lines += [
        "",
        "| t (s) | fault | target | what it showed | steady load meanwhile: p50 / max (requests) |",
        "|---|---|---|---|---|",
    ]
    for f in s["faults"]:
        shown = "; ".join(f["notes"] + [f"**{x}**" for x in f["failures"]])
        lines.append(
            f"| {f['t']:.0f} | {f['kind']} | {f['target']} | {shown} | {f['steady_latency']} |"
        )
    if s.get("wrong_paths"):
        lines += [
            "",
            "| wrong answer at t (s) | request | cached tokens | served by (each attempt) | last fault before |",
            "|---|---|---|---|---|",
        ]
        for w in s["wrong_paths"]:
            paths = "; ".join(_path(a) for a in w["attempts"]) or "(not in the route log)"
            lines.append(
                f"| {w['t']} | {w['spec']} `{w['id']}` | {w['cached_tokens']} | {paths} | {w['last_fault']} |"
            )
    lines += ["", "| check (after the quiet period) | measured | bound | |", "|---|---|---|---|"]
    for c in s["checks"]:
        lines.append(
            f"| {c['name']} | {c['measured']} | {c['bound']} | {'ok' if c['ok'] else '**FAIL**'} |"
        )
    if s["unexpected_kinds"]:
        lines += [
            "",
            "Unexpected errors: "
            + "; ".join(f"{k}: {v}" for k, v in s["unexpected_kinds"].items()),
        ]
    if s["failures"]:
        lines += ["", "Failures:", *(f"- {x}" for x in s["failures"])]
    return "\n".join(lines) + "\n"


def fault_rows(records: list[FaultRecord], tally: Tally, origin: float) -> list[dict[str, Any]]:
    return [
        {
            "t": r.start - origin,
            "kind": r.kind,
            "target": r.target,
            "seconds": round(r.end - r.start, 1),
            "notes": r.notes,
            "failures": r.failures,
            "steady_latency": tally.latency_in(r.start, r.end),
        }
        for r in records
    ]


def request_rows(tally: Tally) -> dict[str, dict[str, Any]]:
    rows = {}
    for source in [s for s in SOURCES if s in tally.counts]:
        c = tally.counts[source]
        rows[source] = {k: c[k] for k in ("sent", "ok", "expected", "wrong", "hang", "unexpected")}
        rows[source]["expected_kinds"] = dict(tally.expected[source])
    return rows


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Run(NamedTuple):
    """What a finished soak leaves to judge."""

    minutes: float
    seed: int
    model: str
    sizes: dict[str, int]
    chaos: Chaos
    monitor: Monitor
    refs: References
    outcomes: list[Outcome]
    checks: list[Check]  # the leak checks after the quiet period
    metrics0: Metrics  # at the start (after the reference answers)
    metrics1: Metrics  # at the end
    rss: list[tuple[float, float]]  # the server's RSS (MiB) over time
    origin: float  # when the soak started (monotonic)
    max_rss_growth_mib: float
    engine: str = ""  # the server's engine settings, as the soak started it ("" for --url)
    # request id -> the route of each of its attempts (GET /admin/routes), for wrong answers
    routes: dict[str, list[dict[str, Any]]] = {}  # noqa: RUF012 - never mutated
    # each node's RSS (MiB) over time, by node id
    node_rss: dict[str, list[tuple[float, float]]] = {}  # noqa: RUF012 - never mutated
    health: list[tuple[float, float]] = []  # noqa: RUF012 - GET /health: (t from the start, seconds)
    max_health_p99_ms: float = 250.0


def wrong_outcomes(run: Run) -> list[Outcome]:
    """The requests judged wrong (their paths are asked of the server before the report)."""
    ctx = Context(run.chaos.doomed, run.chaos.pressure_windows(), run.monitor.not_ready)
    return [
        out
        for out in run.outcomes
        if judge(out, run.refs.answers[out.spec], ctx).category == "wrong"
    ]


def wrong_paths(run: Run, limit: int = 20) -> list[dict[str, Any]]:
    """What served each wrong answer (the first ``limit``): when, its cached prompt tokens,
    each attempt's nodes (a prefill node or the decode node alone), the prefix expected there
    and any pull, and the last fault before it."""
    rows = []
    for out in wrong_outcomes(run)[:limit]:
        before = [r for r in run.chaos.records if r.start <= out.start]
        last = before[-1] if before else None
        rows.append(
            {
                "t": round(out.start - run.origin, 1), "spec": out.spec, "id": out.request_id,
                "cached_tokens": out.cached_tokens, "attempts": run.routes.get(out.request_id, []),
                "last_fault": f"{last.kind} {last.target} at t={last.start - run.origin:.0f} s"
                if last else "-",
            }
        )  # fmt: skip
    return rows


def _path(attempt: dict[str, Any]) -> str:
    where = (
        f"{attempt['prefill']} -> {attempt['decode']}"
        if attempt["prefill"]
        else (f"{attempt['decode']} alone")
    )
    pull = (
        f", pulled {attempt['num_pulled']} from {attempt['pull_from']}"
        if attempt["pull_from"]
        else ""
    )
    return f"{where}, {attempt['num_matched']} expected cached{pull}"


_COUNTER_NAMES = {  # the server's counters the report gives the soak's increase of (a node's
    # go when it dies: the junk-frames faults count what the nodes refused)
    "pd_rerouted_requests": "requests re-routed",
    "pd_failed_nodes": "nodes found dead",
    "pd_server_rejected_messages": "frames the server refused",
    "pd_server_dropped_messages": "node messages the server dropped",
}


def run_checks(run: Run) -> list[Check]:
    """The leak checks, and what the soak saw of nodes, readiness and memory."""
    chaos, monitor, rss = run.chaos, run.monitor, run.rss
    unasked = sorted(set(monitor.left) - set(chaos.doomed) - chaos.drained - chaos.extra_drained)
    deaths = run.metrics1.value("pd_failed_nodes") - run.metrics0.value("pd_failed_nodes")
    not_ready_s = sum(i.end - i.start for i in monitor.not_ready)
    empty_s = sum(i.end - i.start for i in monitor.empty_pools)
    return [
        *run.checks,
        Check("nodes found dead (pd_failed_nodes) / meant to die", f"{deaths:.0f} / {len(chaos.doomed)}", "equal", deaths == len(chaos.doomed)),
        Check("nodes that left with no fault to explain it", ", ".join(unasked) or "none", "none", not unasked),
        Check("seconds a pool had no ready node", f"{empty_s:.1f}", "0", empty_s == 0),
        Check("seconds the server said it was not ready", f"{not_ready_s:.1f}", "0", not_ready_s == 0),
        Check("admin polls unanswered within 10 s", str(monitor.num_errors), "0", monitor.num_errors == 0),
        server_memory_check(rss, run.max_rss_growth_mib),
        node_memory_check(run.node_rss, run.max_rss_growth_mib),
        health_check(run.health, run.max_health_p99_ms),
        disk_off_check(run),
    ]  # fmt: skip


MIN_NODE_LIFE_S = 60.0  # a node sampled for less long is not judged (its warm-up dominates)


def second_half_growth(series: list[tuple[float, float]]) -> tuple[float, float, float]:
    """A process's RSS growth over the second half of its samples (time, MiB): its last sample
    over the most of its first half, which warms its caches up and holds answers in flight as
    large as the second half's (a sample taken while a 16 x 1,000-token logprobs answer is in
    flight is no growth); a leak grows on through the second half. -> (most, last, growth)."""
    half = (series[0][0] + series[-1][0]) / 2
    most = max(r for t, r in series if t <= half)
    return most, series[-1][1], series[-1][1] - most


def server_memory_check(rss: list[tuple[float, float]], bound: float) -> Check:
    """The server's RSS growth over the second half of the soak (``second_half_growth``), its
    first sample and its most beside it."""
    if len(rss) < 2:
        return Check("server RSS over the soak's second half (MiB)", "n/a (no pid)", "", True)
    most, last, growth = second_half_growth(rss)
    measured = (
        f"start {rss[0][1]:.0f}, first half's most {most:.0f}, last {last:.0f} "
        f"(max {max(r for _, r in rss):.0f})"
    )
    return Check(
        "server RSS over the soak's second half (MiB)", measured, f"growth <= {bound:g}",
        growth <= bound,
    )  # fmt: skip


def node_memory_check(samples: dict[str, list[tuple[float, float]]], bound: float) -> Check:
    """Each node's RSS growth over the second half of its life (``second_half_growth``: its
    first half warms its compiled steps and grammar tokenizer up too); nodes that lived less
    than ``MIN_NODE_LIFE_S`` are not judged."""
    growth: dict[str, tuple[float, float, float]] = {}  # node -> (first half's most, last, growth)
    for node, series in samples.items():
        if len(series) < 2 or series[-1][0] - series[0][0] < MIN_NODE_LIFE_S:
            continue
        growth[node] = second_half_growth(series)
    worst = sorted(growth.items(), key=lambda kv: -kv[1][2])[:3]
    measured = (
        f"{len(growth)} nodes judged; most: "
        + ", ".join(f"{n} {m:.0f} -> {last:.0f}" for n, (m, last, _) in worst)
        if growth
        else f"no node sampled for {MIN_NODE_LIFE_S:g} s"
    )
    ok = all(g <= bound for _, _, g in growth.values())
    return Check(
        "node RSS over the second half of each node's life (MiB)",
        measured,
        f"growth <= {bound:g}",
        ok,
    )


def health_check(samples: list[tuple[float, float]], bound_ms: float) -> Check:
    """``GET /health``'s latency over the soak (probes unanswered count as their timeout)."""
    took = [1000 * s for _, s in samples]
    p99 = percentile(took, 0.99)
    slowest = sorted(samples, key=lambda s: -s[1])[:3]
    measured = (
        f"p99 {p99:.0f}, p50 {percentile(took, 0.5):.0f}, max {max(took):.0f} ({len(took)} probes; "
        f"slowest at t = {', '.join(f'{t:.0f} s' for t, _ in slowest)})"
        if took
        else "no probe"
    )
    return Check(
        "GET /health latency throughout (ms)",
        measured,
        f"p99 < {bound_ms:g}",
        bool(took) and p99 < bound_ms,
    )


def disk_off_check(run: Run) -> Check:
    """A node whose disk tier is off must have lived through a read-only window: once the
    directory is writable again, a node started later writes there."""
    windows = run.chaos.readonly_windows
    off = [n for n, v in run.metrics1.by("pd_node_disk_tier_off", "node").items() if v]
    seen = run.monitor.first_seen
    unexplained = [n for n in off if n in seen and not any(seen[n] <= end for _, end in windows)]
    return Check(
        "disk tier off on a node started after every read-only window",
        ", ".join(unexplained) or f"none ({len(off)} off, {len(windows)} windows)",
        "none",
        not unexplained,
    )


def summarize(run: Run) -> dict[str, Any]:
    """The soak's verdicts, checks and failures (JSON-ready; ``render`` makes the report)."""
    ctx = Context(run.chaos.doomed, run.chaos.pressure_windows(), run.monitor.not_ready)
    tally = Tally()
    for out in run.outcomes:
        tally.add(out, judge(out, run.refs.answers[out.spec], ctx))
    total, unexpected = len(run.outcomes), tally.total("unexpected")
    checks = run_checks(run)
    failures = [
        f"{r.kind} at t={r.start - run.origin:.0f} s: {x}"
        for r in run.chaos.records
        for x in r.failures
    ]
    failures += [
        f"check failed: {c.name}: {c.measured} (bound {c.bound})" for c in checks if not c.ok
    ]
    if tally.total("wrong") or tally.total("hang"):
        failures.append(
            f"{tally.total('wrong')} wrong answers, {tally.total('hang')} hangs: "
            + "; ".join(tally.examples)
        )
    if unexpected > MAX_UNEXPECTED_FRACTION * total:
        worst = "; ".join(f"{k}: {v}" for k, v in tally.unexpected.most_common(5))
        failures.append(f"{unexpected} unexpected errors of {total} requests: {worst}")
    latencies = [lat for _, lat in tally.latencies]
    no_max = {s.name for s in run.refs.specs if s.no_max_tokens}
    no_max_verdicts = Counter(
        judge(o, run.refs.answers[o.spec], ctx).category for o in run.outcomes if o.spec in no_max
    )
    return {
        "minutes": run.minutes, "seed": run.seed, "model": run.model,
        "cluster": " + ".join(f"{run.sizes[r]} {r}" for r in ROLES),
        "counts": {
            "total": total, "ok": tally.total("ok"), "expected": tally.total("expected"),
            "wrong": tally.total("wrong"), "hangs": tally.total("hang"), "unexpected": unexpected,
            "unexpected_5xx": tally.num_5xx, "unexpected_pct": 100 * unexpected / max(total, 1),
        },
        "latency": {"p50": round(percentile(latencies, 0.5), 2), "p99": round(percentile(latencies, 0.99), 2)},
        "requests": request_rows(tally),
        "no_max_tokens": {"sent": sum(no_max_verdicts.values()), **no_max_verdicts},
        "unexpected_kinds": dict(tally.unexpected),
        "faults": fault_rows(run.chaos.records, tally, run.origin),
        "fault_kinds_run": sorted({r.kind for r in run.chaos.records if not any(n.startswith("skipped") for n in r.notes)}),
        "checks": [c._asdict() for c in checks],
        "metric_deltas": {n: run.metrics1.total(n) - run.metrics0.total(n) for n in _COUNTER_NAMES},
        "failures": failures,
        "engine": run.engine,
        "wrong_paths": wrong_paths(run),
        # (seconds since the start, MiB) every sample: the server's, and each node's
        "rss": {"server": [(round(t - run.origin, 1), round(r, 1)) for t, r in run.rss],
                "nodes": {n: [(round(t - run.origin, 1), round(r, 1)) for t, r in series]
                          for n, series in run.node_rss.items()}},
    }  # fmt: skip
