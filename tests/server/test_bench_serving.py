"""scripts/bench_serving.py against the server over the fake engine."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from scripts import bench_serving
from tests.server.conftest import serve
from tests.server.fake_engine import FakeEngineClient


def _run_bench(app: Any, tmp_path: Path, argv: list[str], url_suffix: str = "") -> Any:
    """bench_serving.main(argv) against ``app``; its JSON summary."""
    out = tmp_path / "bench.json"
    with serve(app) as url:
        assert bench_serving.main(["--url", url + url_suffix, *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("workload", ["shared-prefix", "fixed"])
def test_bench_serving_reports_latency_throughput_and_cache_hits(
    make_app: Callable[..., tuple[Any, FakeEngineClient]],
    workload: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    app, fake = make_app(num_cached_tokens=5, tokens_per_step=1, delay_s=0.002)
    argv = [
        "--workload", workload, "--num-groups", "2", "--prompts-per-group", "3",
        "--num-prompts", "4", "--prefix-len", "20", "--suffix-len", "5", "--max-tokens", "8",
        "--max-concurrency", "3", "--label", "t",
    ]  # fmt: skip
    summary = _run_bench(app, tmp_path, argv, url_suffix="/v1")
    num = 6 if workload == "shared-prefix" else 4
    assert (summary["num_requests"], summary["num_failed"]) == (num, 0)
    assert summary["output_tokens"] == 8 * num  # the fake's script is longer than max_tokens
    assert summary["prompt_tokens"] == sum(len(p) for _, p, _ in fake.requests)
    expected_hit = 5 * num / summary["prompt_tokens"]
    assert summary["cache_hit_rate_usage"] == pytest.approx(expected_hit)
    assert summary["cache_hit_rate_metrics"] == pytest.approx(expected_hit)
    assert all(params.ignore_eos and params.max_tokens == 8 for _, _, params in fake.requests)
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        p = summary[key]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"], (key, p)
    if workload == "fixed":
        assert len({tuple(p) for _, p, _ in fake.requests}) == 1
    else:  # two groups: two distinct 20-word prefixes
        assert len({tuple(p[:10]) for _, p, _ in fake.requests}) == 2
    table = capsys.readouterr().out
    assert "| TTFT |" in table and "cache hit rate (/metrics)" in table


@pytest.mark.timeout(30)
def test_cached_prefix_warms_up_then_sends_prefix_plus_fresh_ids(
    make_app: Callable[..., tuple[Any, FakeEngineClient]], tmp_path: Path
) -> None:
    app, fake = make_app(num_cached_tokens=32, tokens_per_step=1, delay_s=0.002)
    argv = [
        "--workload", "cached-prefix", "--num-prompts", "3", "--prefix-len", "32",
        "--suffix-len", "4", "--max-tokens", "2", "--max-concurrency", "8",
    ]  # fmt: skip
    summary = _run_bench(app, tmp_path, argv)
    prompts = [p for _, p, _ in fake.requests]
    assert len(prompts) == 4  # the warm-up + 3 measured
    assert all(len(p) == 36 and p[:32] == prompts[0][:32] for p in prompts)
    assert len({tuple(p[32:]) for p in prompts}) == 4  # fresh suffix each time
    assert (summary["num_requests"], summary["num_failed"]) == (3, 0)
    assert summary["config"]["max_concurrency"] == 1  # sequential, whatever was asked
    assert summary["prompt_tokens"] == 3 * 36  # the warm-up is not counted ...
    assert summary["cache_hit_rate_metrics"] == pytest.approx(32 / 36)  # ... nor scraped
    assert summary["ttft_s"]["p50"] > 0


def test_parse_launch_and_compare_table() -> None:
    from pdtools.bench_launch import parse_launch

    launch = parse_launch("cache_aware=--prefill 2 --decode 1 --policy cache_aware")
    assert launch.label == "cache_aware"
    assert launch.args == ["--prefill", "2", "--decode", "1", "--policy", "cache_aware"]
    assert parse_launch("--colocated") == ("--colocated", ["--colocated"], "pd")
    assert parse_launch("llamacpp", "llamacpp") == ("llamacpp", [], "llamacpp")
    assert parse_launch("l=--n_threads 1", "llamacpp").args == ["--n_threads", "1"]
    with pytest.raises(ValueError, match="--port"):
        parse_launch("x=--port 9000")

    def summary(ttft: float, hit: float, answers: list, spec: dict) -> dict[str, Any]:
        p = {"mean": ttft, "p50": ttft, "p90": ttft, "p99": ttft}
        return {
            "num_requests": 4, "num_failed": 0, "ttft_s": p, "tpot_s": p, "itl_s": p,
            "e2e_s": p, "request_throughput": 1.0, "output_throughput": 2.0,
            "cache_hit_rate_usage": hit, "cache_hit_rate_metrics": hit,
            "answers": answers, "spec_counters": spec,
        }  # fmt: skip

    spec = {"spec_verify_steps": 10.0, "spec_draft_tokens": 40.0, "spec_accepted_tokens": 30.0}
    table = bench_serving.compare_markdown(
        [
            ("a", summary(0.2, 0.4, ["x", "y", "z", "w"], {})),
            ("b", summary(0.3, 0.8, ["x", "y", "q", None], spec)),
            ("c", None),
        ]
    )
    rows = [r for r in table.splitlines() if r.startswith("| ")]
    assert len(rows) == 4  # header + 3 runs
    assert rows[1].endswith("| 4 / 4 | - |")
    assert rows[2].endswith("| 1.50× | 2.00× | 2 / 4 | 75%, 4.00/step |")
    assert "did not start" in rows[3]


@pytest.mark.timeout(30)
def test_chat_workload_streams_chat_completions(
    make_app: Callable[..., tuple[Any, FakeEngineClient]],
    tokenizer: Any,
    tmp_path: Path,
) -> None:
    app, fake = make_app(num_cached_tokens=0, tokens_per_step=1, delay_s=0.002)
    argv = [
        "--workload", "chat", "--num-groups", "2", "--prompts-per-group", "3",
        "--prefix-len", "40", "--max-tokens", "6", "--max-concurrency", "2",
    ]  # fmt: skip
    summary = _run_bench(app, tmp_path, argv)
    assert (summary["num_requests"], summary["num_failed"]) == (6, 0)
    assert summary["output_tokens"] == 6 * 6
    prompts = [tokenizer.decode(p) for _, p, _ in fake.requests]
    assert all(p.startswith("<|im_start|>system\nYou answer questions") for p in prompts)
    systems = [p[: p.index("<|im_start|>user")] for p in prompts]
    assert sorted(systems.count(s) for s in set(systems)) == [3, 3]  # 2 groups of 3
    assert len(set(prompts)) == 6  # a different question each
    system_ids = [tokenizer.encode(s.split("\n", 1)[1]) for s in set(systems)]
    assert all(45 <= len(ids) <= 60 for ids in system_ids), [len(i) for i in system_ids]
    assert all(params.ignore_eos and params.max_tokens == 6 for _, _, params in fake.requests)
    assert 0 < summary["ttft_s"]["p50"] <= summary["e2e_s"]["p50"]
    assert summary["itl_s"]["p50"] > 0


@pytest.mark.timeout(60)
def test_trace_replay_sends_block_prompts_at_their_times(
    tokenizer: Any,
    script_ids: list[int],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from pd.server import ServerMetrics, build_app
    from pdtools.trace import BLOCK_SIZE, TraceRequest, write_trace

    fake = FakeEngineClient(script_ids, eos_token_id=tokenizer.eos_token_id, delay_s=0.002)
    app = build_app(
        fake, tokenizer=tokenizer, model_name="m", max_model_len=4096, metrics=ServerMetrics()
    )
    trace = [
        TraceRequest(1000, BLOCK_SIZE + 10, 4, [0, 1]),
        TraceRequest(3000, 2 * BLOCK_SIZE + 3, 6, [0, 2, 3]),
        TraceRequest(7000, BLOCK_SIZE + 200, 2, [0, 4]),
    ]
    path = tmp_path / "trace.jsonl"
    write_trace(path, trace)
    plots = tmp_path / "plots"
    argv = [
        "--workload", "trace", "--trace", str(path), "--time-scale", "0.05",
        "--slo-ttft", "5", "--slo-tpot", "1", "--plot-dir", str(plots),
    ]  # fmt: skip
    summary = _run_bench(app, tmp_path, argv)
    assert (summary["num_requests"], summary["num_failed"]) == (3, 0)
    assert summary["duration_s"] >= 0.3  # the last arrives (7000 - 1000) ms × 0.05 after start
    sent = sorted(fake.requests, key=lambda r: len(r[1]))
    assert [len(p) for _, p, _ in sent] == [r.input_length for r in (trace[0], trace[2], trace[1])]
    assert [params.max_tokens for _, _, params in fake.requests] == [4, 6, 2]  # in time order
    firsts = {tuple(p[:BLOCK_SIZE]) for _, p, _ in fake.requests}
    assert len(firsts) == 1  # hash id 0 everywhere
    assert summary["output_tokens"] == 4 + 6 + 2
    assert (summary["goodput"], summary["slo_attainment"]) == (
        pytest.approx(3 / summary["duration_s"]),
        1.0,
    )
    assert (plots / "ttft_cdf.png").stat().st_size > 0 and (plots / "goodput.png").is_file()
    assert "goodput req/s | SLO met" in capsys.readouterr().out
