"""Overload against the colocated engine on a tiny model, load from a second process
(``flood_client.py``): a flood of 10x the admission limit gets only 200s and 429s, admitted
requests keep their speed, memory stays flat; 40 MB bodies get 413 and slow nobody.

The issue's flood runs 30 s; here three rounds of 2.5 s floods keep the suite bounded (the
ratio and the statuses are what it checks, not endurance). ``PD_FLOOD_SECONDS=30`` runs one
round of that length instead (see RELIABILITY.md for its numbers).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pd.server import ServerConfig
from tests.server.conftest import check_idle, colocated_app, serve

pytestmark = pytest.mark.timeout(90)

_CLIENT = Path(__file__).with_name("flood_client.py")
_ROOT = Path(__file__).resolve().parents[2]
LIMIT = 4
FLOOD_S = float(os.environ.get("PD_FLOOD_SECONDS", "2.5"))
ROUNDS = 3 if FLOOD_S <= 5 else 1


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[tuple[str, Any, Any]]:
    # No queue: a 200's latency is then all service time, comparable with the unloaded run.
    config = ServerConfig(max_inflight_requests=LIMIT, max_queued_requests=0)
    client, app = colocated_app(tiny_llama_dir, config, max_total_tokens=2048)
    try:
        with serve(app) as url:
            yield url, client, app
    finally:
        client.shutdown()


def _client_cmd(url: str, *args: str) -> list[str]:
    return [sys.executable, str(_CLIENT), url, *args]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(_ROOT)}


def _lowest_priority() -> None:
    # The load generator must not take the CPU the server under test needs (2 cores here).
    os.nice(19)


def _run(url: str, *args: str) -> Any:
    done = subprocess.run(
        _client_cmd(url, *args),
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60 + 4 * ROUNDS * FLOOD_S,
        preexec_fn=_lowest_priority,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _rss_mib() -> float:
    gc.collect()
    with open("/proc/self/statm") as f:  # size, resident, ... in pages
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.slow
@pytest.mark.timeout(90 + 4 * ROUNDS * FLOOD_S)
def test_flood_is_200s_and_429s_and_admitted_requests_keep_their_speed(
    server: tuple[str, Any, Any],
) -> None:
    """Rounds of an unloaded phase (LIMIT clients) then a flood (10 x LIMIT clients that honour
    Retry-After). Admitted requests' latency is the server's own (its e2e histogram, per
    phase): the clients' clocks, in a load generator at the lowest priority on a shared 2-core
    machine, measure their own starvation too (printed, not asserted). Background load swings
    latencies within seconds, so each flood is compared with the unloaded phase just before
    it, and the median round must be within 2x.
    """
    url, client, app = server
    rss_before = _rss_mib()
    rounds = _run(url, "--limit", str(LIMIT), "--rounds", str(ROUNDS), "--duration", str(FLOOD_S))
    rss_after = _rss_mib()

    client_ratios, server_ratios = [], []
    for r in rounds:
        unloaded, flood = r["unloaded"], r["flood"]
        assert set(unloaded["statuses"]) == {"200"}, unloaded["statuses"]
        assert set(flood["statuses"]) == {"200", "429"}, flood["statuses"]
        p50 = statistics.median(flood["latencies"]) / statistics.median(unloaded["latencies"])
        client_ratios.append(p50)
        server_ratios.append(flood["server_mean"] / unloaded["server_mean"])
    print(
        "flood/unloaded latency of 200s per round, client p50: "
        + ", ".join(f"{x:.2f}x" for x in client_ratios)
        + "; server mean: "
        + ", ".join(f"{x:.2f}x" for x in server_ratios)
        + f"; flood statuses {[r['flood']['statuses'] for r in rounds]}; "
        f"RSS {rss_before:.0f} -> {rss_after:.0f} MiB"
    )
    assert statistics.median(server_ratios) <= 2.0, server_ratios
    assert rss_after - rss_before < 32, (rss_before, rss_after)
    refused = sum(r["flood"]["statuses"]["429"] for r in rounds)
    metrics = app.state.server.metrics.render().decode()
    assert f'pd_server_rejected_requests_total{{reason="queue_full"}} {refused}.0' in metrics
    check_idle(client, app)


@pytest.mark.slow
def test_40mb_bodies_get_413_and_slow_nobody(server: tuple[str, Any, Any]) -> None:
    url, client, app = server
    alone = _run(url, "--concurrency", "1", "--duration", "2.5")
    big = subprocess.Popen(
        _client_cmd(url, "--big-bodies", "40", "--duration", "3"),
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
        preexec_fn=_lowest_priority,
    )
    beside = _run(url, "--concurrency", "1", "--duration", "3.5")
    out, _ = big.communicate(timeout=60)
    bodies = json.loads(out.strip().splitlines()[-1])

    for kind in ("declared", "chunked"):
        assert {(s, c) for s, c, _ in bodies[kind]} == {(413, "request_too_large")}, bodies[kind]
    assert {(s, c) for s, c, _ in bodies["parsed"]} == {(400, "context_length_exceeded")}
    base = statistics.median(alone["latencies"])
    during = statistics.median(beside["latencies"])
    sent = {k: len(v) for k, v in bodies.items()}
    print(f"alone p50 {base * 1e3:.1f} ms; beside {sent} big bodies p50 {during * 1e3:.1f} ms")
    assert set(beside["statuses"]) == {"200"} and during <= 2.0 * base, (during, base)
    check_idle(client, app)
