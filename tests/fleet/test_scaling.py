"""Pools scale independently at runtime: a node joins and takes work; a node leaves after draining."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.cluster.conftest import start_live_cluster, wait_idle_and_check

MODEL = "SmolLM2-135M-Instruct"


def _complete(url: str, prompt: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


@pytest.mark.timeout(300)
def test_add_prefill_node_then_drain_and_remove_it(ray_session, smollm2_dir):
    live, stop = start_live_cluster(1, 1, policy="round_robin")
    try:
        cluster = live.cluster
        coordinator = cluster.client.coordinator
        new = cluster.add_node("prefill")
        assert sorted(coordinator.nodes.prefill_nodes) == ["prefill-0", new]
        routed: list[str] = []
        route = coordinator.route

        def spy(*args, **kwargs):
            r = route(*args, **kwargs)
            routed.append(r.prefill)
            return r

        coordinator.route = spy
        for i in range(4):
            assert _complete(live.url, f"Count to {i}:").status_code == 200
        assert set(routed) == {"prefill-0", new}, routed

        # requests in flight on the node being removed still finish
        results: list[httpx.Response] = []
        threads = [
            threading.Thread(
                target=lambda i=i: results.append(_complete(live.url, f"Story {i}:", 24))
            )
            for i in range(4)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(routed) < 8:
            assert time.monotonic() < deadline, f"requests not routed: {routed}"
            time.sleep(0.05)
        cluster.remove_node(new)
        for t in threads:
            t.join(timeout=120)
        assert [r.status_code for r in results] == [200] * 4, [r.text for r in results]
        assert coordinator.nodes.prefill_nodes == ["prefill-0"] and cluster.pools[new].actor is None
        assert _complete(live.url, "After removal:").status_code == 200
        wait_idle_and_check(live)
    finally:
        stop()


@pytest.mark.timeout(300)
def test_a_cluster_without_prefill_pool_prefills_on_its_decode_node_and_grows_one_and_back(
    ray_session, smollm2_dir
):
    """``--prefill 0`` (pd serve's default on one CPU machine): the decode node prefills every
    prompt (even with conditional disaggregation off, as here); a prefill node added takes the
    prompts, and once it is drained away the decode node prefills them again."""
    live, stop = start_live_cluster(0, 1)
    try:
        cluster = live.cluster
        coordinator = cluster.client.coordinator
        prompt = "The capital of France is"
        first = _complete(live.url, prompt, 8)
        assert first.status_code == 200, first.text
        assert coordinator.num_local_routes == 1 and coordinator.decode_only
        new = cluster.add_node("prefill")
        assert coordinator.nodes.prefill_nodes == [new] and not coordinator.decode_only
        via_prefill = _complete(live.url, prompt, 8)
        assert via_prefill.json()["choices"] == first.json()["choices"]
        assert coordinator.num_local_routes == 1  # through the prefill node, its KV moved
        cluster.remove_node(new)
        assert coordinator.nodes.prefill_nodes == [] and coordinator.decode_only
        assert httpx.get(f"{live.url}/ready", timeout=5).status_code == 200
        again = _complete(live.url, prompt, 8)
        assert again.json()["choices"] == first.json()["choices"]
        assert coordinator.num_local_routes == 2
        wait_idle_and_check(live)
    finally:
        stop()
