"""scripts/bench_serving.py against the server over the fake engine."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import serve
from tests.server.fake_engine import FakeEngineClient

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_serving.py"


def _load_bench() -> Any:
    if str(_SCRIPT.parent) not in sys.path:  # as when run as a script: bench_launch beside it
        sys.path.insert(0, str(_SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("bench_serving", _SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(30)
@pytest.mark.parametrize("workload", ["shared-prefix", "fixed"])
def test_bench_serving_reports_latency_throughput_and_cache_hits(
    make_app: Callable[..., tuple[Any, FakeEngineClient]],
    workload: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench = _load_bench()
    app, fake = make_app(num_cached_tokens=5, tokens_per_step=1, delay_s=0.002)
    out = tmp_path / "bench.json"
    with serve(app) as url:
        argv = [
            "--url", f"{url}/v1", "--workload", workload, "--num-groups", "2",
            "--prompts-per-group", "3", "--num-prompts", "4", "--prefix-len", "20",
            "--suffix-len", "5", "--max-tokens", "8", "--max-concurrency", "3",
            "--label", "t", "--json", str(out),
        ]  # fmt: skip
        assert bench.main(argv) == 0
    summary = json.loads(out.read_text())
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
    bench = _load_bench()
    app, fake = make_app(num_cached_tokens=32, tokens_per_step=1, delay_s=0.002)
    out = tmp_path / "bench.json"
    with serve(app) as url:
        argv = [
            "--url", url, "--workload", "cached-prefix", "--num-prompts", "3",
            "--prefix-len", "32", "--suffix-len", "4", "--max-tokens", "2",
            "--max-concurrency", "8", "--json", str(out),
        ]  # fmt: skip
        assert bench.main(argv) == 0
    summary = json.loads(out.read_text())
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
    bench = _load_bench()
    from bench_launch import parse_launch

    launch = parse_launch("cache_aware=--prefill 2 --decode 1 --policy cache_aware")
    assert launch.label == "cache_aware"
    assert launch.args == ["--prefill", "2", "--decode", "1", "--policy", "cache_aware"]
    assert parse_launch("--colocated") == ("--colocated", ["--colocated"])
    with pytest.raises(ValueError, match="--port"):
        parse_launch("x=--port 9000")

    def summary(ttft: float, hit: float) -> dict[str, Any]:
        p = {"mean": ttft, "p50": ttft, "p90": ttft, "p99": ttft}
        return {
            "num_requests": 4, "num_failed": 0, "ttft_s": p, "tpot_s": p, "itl_s": p,
            "e2e_s": p, "request_throughput": 1.0, "output_throughput": 2.0,
            "cache_hit_rate_usage": hit, "cache_hit_rate_metrics": hit,
        }  # fmt: skip

    table = bench.compare_markdown(
        [("a", summary(0.2, 0.4)), ("b", summary(0.3, 0.8)), ("c", None)]
    )
    rows = [r for r in table.splitlines() if r.startswith("| ")]
    assert len(rows) == 4  # header + 3 runs
    assert rows[2].endswith("| 1.50× | 2.00× |")
    assert "did not start" in rows[3]
