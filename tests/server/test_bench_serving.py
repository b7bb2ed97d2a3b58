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
