"""pdtools/bench_report.py: goodput on known latencies, the goodput table, the PNG plots."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdtools.bench_client import Result
from pdtools.bench_report import goodput, goodput_markdown, summarize, write_plots


def _result(ttft: float, e2e: float, num_tokens: int) -> Result:
    return Result(ok=True, ttft=ttft, e2e=e2e, output_tokens=num_tokens, prompt_tokens=100)


def _results() -> list[Result]:
    return [
        _result(0.5, 0.5 + 9 * 0.05, 10),  # meets both (TPOT 50 ms)
        _result(1.0, 1.0 + 9 * 0.10, 10),  # both exactly at the objectives: meets
        _result(1.5, 1.5 + 9 * 0.05, 10),  # TTFT over
        _result(0.2, 0.2 + 9 * 0.20, 10),  # TPOT over
        _result(0.3, 0.3, 1),  # one token: no TPOT, meets
        Result(ok=False, error="HTTP 500"),  # failed: meets nothing
    ]


def test_goodput_counts_requests_within_both_objectives() -> None:
    g = goodput(_results(), duration=2.0, slo_ttft=1.0, slo_tpot=0.1)
    assert g.num_met == 3
    assert g.rate == pytest.approx(1.5)
    assert g.attainment == pytest.approx(0.5)
    assert goodput(_results(), 2.0, slo_ttft=2.0, slo_tpot=1.0).num_met == 5
    assert goodput([], 1.0, 1.0, 1.0) == (0, 0.0, 0.0)


def _summary(label: str, scale: float) -> dict:
    args = argparse.Namespace(
        label=label, workload="trace", slo_ttft=1.0, slo_tpot=0.1, time_scale=0.5, json=None
    )
    results = [
        Result(r.ok, r.ttft * scale, r.e2e * scale, output_tokens=r.output_tokens)
        for r in _results()
    ]
    return summarize(args, results, 2.0, {}, {})


def test_summary_and_goodput_table() -> None:
    s = _summary("fast", 1.0)
    assert (s["goodput"], s["slo_attainment"]) == (pytest.approx(1.5), pytest.approx(0.5))
    assert s["ttft_values_s"] == sorted([0.5, 1.0, 1.5, 0.2, 0.3])
    assert "json" not in s["config"] and s["config"]["slo_ttft"] == 1.0
    table = goodput_markdown([("fast", s), ("slow", _summary("slow", 3.0))])
    rows = [r for r in table.splitlines() if r.startswith("| ")]
    assert len(rows) == 3
    assert rows[1].startswith("| fast | 5 / 6 | 1.500 | 50.0% |")
    assert rows[2].startswith("| slow | 5 / 6 | 0.500 | 16.7% |")  # only the 1-token request
    assert "TTFT <= 1000 ms and TPOT <= 100 ms (trace time scale 0.5)" in table


@pytest.mark.timeout(60)
def test_plots_are_written(tmp_path: Path) -> None:
    rows = [("1p1d", _summary("1p1d", 1.0)), ("colocated", _summary("colocated", 2.0))]
    paths = write_plots(rows, tmp_path / "plots")
    assert [p.name for p in paths] == ["ttft_cdf.png", "goodput.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, (p, len(data))


def test_summary_counts_pd_routing_from_the_metrics_delta() -> None:
    args = argparse.Namespace(label="x", workload="trace", slo_ttft=1.0, slo_tpot=0.1, json=None)
    before = {"pd_local_prefills": 3.0, "pd_pull_decisions_pull": 1.0}
    after = {"pd_local_prefills": 10.0, "pd_pull_decisions_pull": 1.0}
    s = summarize(args, _results(), 2.0, before, after)
    assert s["routing_counters"] == {"local_prefills": 7.0, "pull_decisions_pull": 0.0}
    assert summarize(args, _results(), 2.0, {}, {})["routing_counters"] == {}  # not pd


def test_summary_keeps_the_answers_and_counts_speculation() -> None:
    args = argparse.Namespace(label="x", workload="copy", slo_ttft=1.0, slo_tpot=0.1, json=None)
    results = [Result(ok=True, ttft=0.1, e2e=0.2, output_tokens=2, text="hi"), Result(ok=False)]
    before = {"pd_node_spec_draft_tokens": 4.0}
    after = {"pd_node_spec_draft_tokens": 10.0, "pd_node_spec_accepted_tokens": 5.0}
    s = summarize(args, results, 1.0, before, after)
    assert s["answers"] == ["hi", None]
    assert s["spec_counters"] == {"spec_draft_tokens": 6.0, "spec_accepted_tokens": 5.0}
