"""Faults on a live cluster: a node dies, requests fail cleanly instead of hanging, the rest go on."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import ray

from tests.cluster.conftest import start_live_cluster, wait_idle_and_check

MODEL = "SmolLM2-135M-Instruct"


@pytest.mark.timeout(240)
def test_prefill_node_dies_requests_fail_cleanly_and_survivor_serves(ray_session, smollm2_dir):
    live, stop = start_live_cluster(2, 1, policy="round_robin")
    try:
        cluster = live.cluster
        victim = "prefill-0"
        # a long prompt keeps the victim busy prefilling when it is killed
        body = {"model": MODEL, "prompt": "word " * 3000, "max_tokens": 8, "temperature": 0}
        results: list[httpx.Response] = []

        def send() -> None:
            results.append(httpx.post(f"{live.url}/v1/completions", json=body, timeout=120))

        threads = [threading.Thread(target=send) for _ in range(2)]  # round robin: one per node
        for t in threads:
            t.start()
        time.sleep(1.5)
        ray.kill(cluster.actors[victim])
        t0 = time.monotonic()
        for t in threads:
            t.join(timeout=90)
        assert not any(t.is_alive() for t in threads), "a request hung after its node died"
        assert time.monotonic() - t0 < 60
        codes = sorted(r.status_code for r in results)
        assert codes[0] == 200, [r.text for r in results]
        failed = [r for r in results if r.status_code != 200]
        assert len(failed) == 1, [r.text for r in results]  # the request on the victim
        for r in failed:
            assert r.status_code == 500 and "failed" in r.json()["error"]["message"]
        assert victim in cluster.client.dead_nodes
        assert httpx.get(f"{live.url}/health", timeout=5).status_code == 200  # 1P + 1D remain
        # the survivor takes new work
        ok = httpx.post(
            f"{live.url}/v1/completions",
            json={"model": MODEL, "prompt": "Water boils at", "max_tokens": 8, "temperature": 0},
            timeout=60,
        )
        assert ok.status_code == 200, ok.text
        # Ray's lifecycle plane replaces the dead node; the newcomer takes work too
        deadline = time.monotonic() + 90
        while not cluster.replacements:
            assert time.monotonic() < deadline, "no replacement node started"
            time.sleep(0.2)
        newcomer = cluster.replacements[0]
        assert sorted(cluster.client.coordinator.prefill_nodes) == sorted(["prefill-1", newcomer])
        assert victim not in cluster.actors
        for i in range(2):  # round robin: one of these lands on the newcomer
            r = httpx.post(
                f"{live.url}/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": f"Count to {i}:",
                    "max_tokens": 4,
                    "temperature": 0,
                },
                timeout=60,
            )
            assert r.status_code == 200, r.text
        wait_idle_and_check(live)
    finally:
        stop()
