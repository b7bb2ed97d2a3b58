"""scripts/bench_serving.py's summaries: percentiles, goodput, markdown tables and PNG plots."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any, NamedTuple

from pdtools.bench_client import Result

_PD_PROMPT = "pd_prompt_tokens_total"
_PD_CACHED = "pd_cached_prompt_tokens_total"
_PD_ROUTING = (
    "pd_local_prefills",
    "pd_pull_decisions_pull",
    "pd_pull_decisions_compute",
    "pd_pull_fallbacks",
)
_PD_SPEC = (  # speculative decoding, summed over the nodes
    "pd_node_spec_verify_steps",
    "pd_node_spec_draft_tokens",
    "pd_node_spec_accepted_tokens",
)
_NO_CONFIG = ("json", "label", "launch", "plot_dir")  # not part of what was measured


class Goodput(NamedTuple):
    num_met: int  # requests that succeeded within both objectives
    rate: float  # num_met per second of the run
    attainment: float  # num_met / requests sent


def goodput(results: list[Result], duration: float, slo_ttft: float, slo_tpot: float) -> Goodput:
    """Requests meeting TTFT <= slo_ttft and TPOT <= slo_tpot (one-token outputs have no TPOT
    and meet it); failed requests meet nothing."""

    def met(r: Result) -> bool:
        return r.ok and r.ttft <= slo_ttft and (r.tpot is None or r.tpot <= slo_tpot)

    num_met = sum(met(r) for r in results)
    return Goodput(num_met, num_met / duration, num_met / len(results) if results else 0.0)


def _pcts(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    qs = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"mean": statistics.fmean(values), "p50": qs[49], "p90": qs[89], "p99": qs[98]}


def _finite(v: Any) -> Any:
    return None if v == float("inf") else v  # JSON has no Infinity


def summarize(
    args: argparse.Namespace,
    results: list[Result],
    duration: float,
    before: dict[str, float],
    after: dict[str, float],
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    server_hit = None
    if _PD_PROMPT in after:
        d_prompt = after[_PD_PROMPT] - before.get(_PD_PROMPT, 0.0)
        d_cached = after.get(_PD_CACHED, 0.0) - before.get(_PD_CACHED, 0.0)
        server_hit = d_cached / d_prompt if d_prompt else None
    errors = sorted({r.error for r in results if not r.ok})
    good = goodput(results, duration, args.slo_ttft, args.slo_tpot)
    return {
        "label": args.label,
        "config": {k: _finite(v) for k, v in vars(args).items() if k not in _NO_CONFIG},
        "num_requests": len(results),
        "num_failed": len(results) - len(ok),
        "errors": errors[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "goodput": good.rate,
        "slo_attainment": good.attainment,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "cache_hit_rate_usage": (sum(r.cached_tokens for r in ok) / prompt_tokens)
        if prompt_tokens
        else None,
        "cache_hit_rate_metrics": server_hit,
        "routing_counters": {  # where pd's coordinator sent the work, when it says
            name.removeprefix("pd_"): after[name] - before.get(name, 0.0)
            for name in _PD_ROUTING
            if name in after
        },
        "spec_counters": {
            name.removeprefix("pd_node_"): after[name] - before.get(name, 0.0)
            for name in _PD_SPEC
            if name in after
        },
        "answers": [r.text if r.ok else None for r in results],  # in request order
        "ttft_s": _pcts([r.ttft for r in ok]),
        "tpot_s": _pcts([t for r in ok if (t := r.tpot) is not None]),
        "itl_s": _pcts([x for r in ok for x in r.itls]),
        "e2e_s": _pcts([r.e2e for r in ok]),
        "ttft_values_s": sorted(r.ttft for r in ok),  # for the TTFT CDF
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def markdown(s: dict[str, Any]) -> str:
    c = s["config"]
    lines = [
        f"### {s['label'] or c['workload']}: {s['num_requests']} requests "
        f"({s['num_failed']} failed) in {s['duration_s']:.2f} s",
        "",
        "| latency (ms) | mean | p50 | p90 | p99 |",
        "|---|---:|---:|---:|---:|",
    ]
    for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        p = s[key]
        lines.append(
            f"| {name} | {_ms(p['mean'])} | {_ms(p['p50'])} | {_ms(p['p90'])} | {_ms(p['p99'])} |"
        )
    slo = f"TTFT <= {c['slo_ttft'] * 1000:.0f} ms, TPOT <= {c['slo_tpot'] * 1000:.0f} ms"
    lines += [
        "",
        "| throughput / cache | value |",
        "|---|---:|",
        f"| requests/s | {s['request_throughput']:.2f} |",
        f"| goodput req/s ({slo}) | {s['goodput']:.2f} ({_rate(s['slo_attainment'])} met) |",
        f"| output tokens/s | {s['output_throughput']:.1f} |",
        f"| prompt / output tokens | {s['prompt_tokens']} / {s['output_tokens']} |",
        f"| cache hit rate (usage) | {_rate(s['cache_hit_rate_usage'])} |",
        f"| cache hit rate (/metrics) | {_rate(s['cache_hit_rate_metrics'])} |",
    ]
    lines += [f"| {name} | {value:.0f} |" for name, value in s["routing_counters"].items()]
    if s["errors"]:
        lines += ["", "errors: " + "; ".join(s["errors"])]
    return "\n".join(lines)


def _ratio(v: float | None, first: float | None) -> str:
    return "-" if v is None or not first else f"{v / first:.2f}×"


def _hit(s: dict[str, Any] | None) -> float | None:
    if s is None:
        return None
    m = s["cache_hit_rate_metrics"]
    return m if m is not None else s["cache_hit_rate_usage"]


def compare_markdown(rows: list[tuple[str, dict[str, Any] | None]]) -> str:
    """One row per launch (None: it did not start), with ratios to the first row."""
    lines = [
        "| run | ok / sent | TTFT p50 | TTFT p90 | TTFT p99 | TPOT p50 | ITL p50 | E2E p50 "
        "| E2E p99 | req/s | out tok/s | hit rate (usage) | hit rate (/metrics) "
        "| TTFT p50 vs first | hit rate vs first | answers = first | drafts accepted |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    first = rows[0][1] if rows else None
    for label, s in rows:
        if s is None:
            lines.append(f"| {label} | did not start |" + " |" * 15)
            continue
        t, e = s["ttft_s"], s["e2e_s"]
        ok = s["num_requests"] - s["num_failed"]
        cells = [
            label, f"{ok} / {s['num_requests']}",
            _ms(t["p50"]), _ms(t["p90"]), _ms(t["p99"]),
            _ms(s["tpot_s"]["p50"]), _ms(s["itl_s"]["p50"]), _ms(e["p50"]), _ms(e["p99"]),
            f"{s['request_throughput']:.2f}", f"{s['output_throughput']:.1f}",
            _rate(s["cache_hit_rate_usage"]), _rate(s["cache_hit_rate_metrics"]),
            _ratio(t["p50"], first["ttft_s"]["p50"] if first else None),
            _ratio(_hit(s), _hit(first)),
            _same_answers(s, first), _accepted(s),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(["latencies in ms", "", *lines])


def _same_answers(s: dict[str, Any], first: dict[str, Any] | None) -> str:
    """How many answers equal the first run's answer to the same request."""
    mine, theirs = s.get("answers"), (first or {}).get("answers")
    if not mine or not theirs or len(mine) != len(theirs):
        return "-"
    same = sum(a is not None and a == b for a, b in zip(mine, theirs))
    return f"{same} / {len(mine)}"


def _accepted(s: dict[str, Any]) -> str:
    """Drafted tokens accepted, and tokens per verify step, from pd's counters."""
    c = s.get("spec_counters") or {}
    drafted, steps = c.get("spec_draft_tokens"), c.get("spec_verify_steps")
    if not drafted or not steps:
        return "-"
    accepted = c.get("spec_accepted_tokens", 0.0)
    return f"{accepted / drafted:.0%}, {1 + accepted / steps:.2f}/step"


def goodput_markdown(rows: list[tuple[str, dict[str, Any]]]) -> str:
    """The trace replay's table: goodput under the SLOs, and the latencies behind it."""
    c = rows[0][1]["config"]
    lines = [
        f"goodput: requests/s with TTFT <= {c['slo_ttft'] * 1000:.0f} ms and TPOT <= "
        f"{c['slo_tpot'] * 1000:.0f} ms (trace time scale {c['time_scale']})",
        "",
        "| run | ok / sent | goodput req/s | SLO met | req/s | TTFT p50 | TTFT p90 | TTFT p99 "
        "| TPOT p50 | TPOT p90 | hit rate |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, s in rows:
        t, tp = s["ttft_s"], s["tpot_s"]
        cells = [
            label, f"{s['num_requests'] - s['num_failed']} / {s['num_requests']}",
            f"{s['goodput']:.3f}", _rate(s["slo_attainment"]), f"{s['request_throughput']:.3f}",
            _ms(t["p50"]), _ms(t["p90"]), _ms(t["p99"]), _ms(tp["p50"]), _ms(tp["p90"]),
            _rate(_hit(s)),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_plots(rows: list[tuple[str, dict[str, Any]]], plot_dir: str | Path) -> list[Path]:
    """ttft_cdf.png (one line per run; failed requests never reach the top) and goodput.png
    (per run: requests/s served, and within the objectives); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    c = rows[0][1]["config"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, s in rows:
        ttfts = s["ttft_values_s"]
        fractions = [(i + 1) / s["num_requests"] for i in range(len(ttfts))]
        ax.step(ttfts, fractions, where="post", label=label)
    ax.axvline(c["slo_ttft"], color="grey", linestyle="--", label="TTFT objective")
    ax.set_xscale("log")  # runs may differ by orders of magnitude
    ax.set(xlabel="TTFT (s)", ylabel="fraction of requests", ylim=(0, 1.02), title="TTFT CDF")
    ax.legend()
    fig.tight_layout()
    paths = [out / "ttft_cdf.png", out / "goodput.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(rows))
    served = [s["request_throughput"] for _, s in rows]
    ax.bar([x - 0.2 for x in xs], served, width=0.4, color="lightgrey", label="served")
    bars = ax.bar([x + 0.2 for x in xs], [s["goodput"] for _, s in rows], width=0.4)
    bars.set_label("within the objectives")
    ax.bar_label(bars, labels=[f"{s['slo_attainment']:.0%}" for _, s in rows])
    ax.set_xticks(list(xs), [label for label, _ in rows], rotation=20, ha="right")
    ax.set_ylim(0, 1.2 * max(served) or 1.0)
    ax.set(
        ylabel="requests/s",
        title=f"goodput: TTFT <= {c['slo_ttft']:g} s, TPOT <= {c['slo_tpot'] * 1000:g} ms",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths
