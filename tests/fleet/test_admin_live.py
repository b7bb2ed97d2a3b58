"""The admin API and the probes on a real cluster (Ray, 3 prefill + 1 decode nodes of the tiny
model, one thread each), behind tenant and admin keys, in order:

1. draining one of three prefill nodes through ``POST /admin/nodes/{id}/drain``: exactly that
   node leaves, the pool settles at 2, no other node drains and none starts in its place (a
   tenant key is refused first, and changes nothing);
2. ``POST /admin/scale`` past what the cluster can place: 409 with the numbers, no node starts;
3. the last decode node killed (SIGKILL on its process): ``/ready`` is 503 within the heartbeat
   timeout, naming the pool, and 200 again once the replacement is ready; ``/health`` answers
   200 all along, and names no node.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from pd.cluster.client_config import ClientConfig
from pd.fleet.pools import NodeState
from pd.server import ServerConfig
from tests.cluster.conftest import LiveCluster, start_live_cluster, wait_idle_and_check
from transfer.state import TransferConfig

pytestmark = pytest.mark.timeout(240)  # the cluster's start-up is counted too
HEARTBEAT_S = 4.0
ADMIN = {"Authorization": "Bearer live-admin-0123456789"}
TENANT = {"Authorization": "Bearer live-tenant-0123456789"}


@pytest.fixture(scope="module")
def live(ray_session: None, tiny_llama_dir: Any) -> Iterator[LiveCluster]:
    keys = ServerConfig(
        api_key=(TENANT["Authorization"][7:],), admin_api_key=(ADMIN["Authorization"][7:],)
    )
    live, stop = start_live_cluster(
        num_prefill=3,
        num_decode=1,
        model=str(tiny_llama_dir),
        server_cfg=keys,
        client=ClientConfig(heartbeat_timeout_s=HEARTBEAT_S, request_timeout_s=60.0),
        # sockets that take more connections than the machine's memory has nodes: the 409
        # test below is about the memory bound (the sockets' has its own test)
        transfer=TransferConfig(max_conns=4096),
    )
    yield live
    stop()


def _until(cond: Callable[[], bool], what: str, timeout_s: float) -> float:
    """Seconds until ``cond()`` held (polled every 50 ms); fails after ``timeout_s``."""
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - start


def _pools(live: LiveCluster) -> dict[str, Any]:
    r = httpx.get(f"{live.url}/admin/nodes", headers=ADMIN, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _generate(live: LiveCluster) -> list[int]:
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 4}}
    r = httpx.post(f"{live.url}/generate", json=body, headers=TENANT, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_draining_one_of_three_prefill_nodes_drains_exactly_one(live: LiveCluster) -> None:
    cluster: Any = live.cluster
    url = f"{live.url}/admin/nodes/prefill-1/drain"
    assert httpx.post(url, headers=TENANT, timeout=10).status_code == 403
    assert httpx.post(url, timeout=10).status_code == 401
    assert cluster.target["prefill"] == 3 and not cluster.pools.nodes(NodeState.DRAINING)
    r = httpx.post(url, headers=ADMIN, timeout=10)
    assert r.status_code == 202, r.text
    assert r.json()["target"] == {"prefill": 2, "decode": 1}
    states = {n["id"]: n["state"] for n in r.json()["nodes"]}
    assert states == {
        "prefill-0": "ready", "prefill-1": "draining", "prefill-2": "ready", "decode-0": "ready",
    }  # fmt: skip
    _until(lambda: "prefill-1" not in cluster.client.membership.nodes, "prefill-1 gone", 60)
    time.sleep(1.0)  # a replacement would be starting by now (the bug started one at once)
    pools = _pools(live)
    assert pools["target"] == {"prefill": 2, "decode": 1}
    assert [(n["id"], n["state"]) for n in pools["nodes"]] == [
        ("prefill-0", "ready"), ("prefill-2", "ready"), ("decode-0", "ready"),
    ]  # fmt: skip
    launched = sorted(n.node_id for n in cluster.pools.nodes())
    assert launched == ["decode-0", "prefill-0", "prefill-1", "prefill-2"]
    pending = [
        n for n in cluster.pools.nodes() if n.state in (NodeState.STARTING, NodeState.DRAINING)
    ]
    assert not pending, pending
    assert len(_generate(live)) == 4
    wait_idle_and_check(live)


def test_scaling_past_what_the_cluster_can_place_is_409_with_the_numbers(
    live: LiveCluster,
) -> None:
    cluster: Any = live.cluster
    r = httpx.post(f"{live.url}/admin/scale", json={"prefill": 1024}, headers=ADMIN, timeout=30)
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    # a CPU node without custom resources takes its memory (the largest a node measures):
    # CPU nodes share cores, so this machine's 2 cores are no bound
    rss = max(s.rss_bytes for s in cluster.client.membership.node_stats.values())
    found = re.match(
        r"asked for 1024 prefill nodes, the cluster can place at most (\d+): a prefill node "
        r"takes memory (\d+\.\d\d) GiB; the cluster has memory (\d+\.\d\d) GiB, of which "
        r"the 1 decode node\(s\) hold memory (\d+\.\d\d) GiB",
        err["message"],
    )
    assert found, err
    most, node_gib, total_gib, held_gib = int(found[1]), *map(float, found.groups()[1:])
    assert 0.5 < node_gib * 2**30 / rss < 2.0, (node_gib, rss)  # what the nodes report
    assert total_gib == round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 2)
    # the message rounds to 0.01 GiB: the bound it implies, within that rounding
    expected = (total_gib - held_gib) / node_gib
    assert held_gib == node_gib and abs(most - expected) <= 0.02 * expected + 1, (most, expected)
    assert err["param"] == "prefill" and err["code"] == "insufficient_capacity"
    assert cluster.target == {"prefill": 2, "decode": 1}
    assert not cluster.pools.nodes(NodeState.STARTING)
    r = httpx.post(f"{live.url}/admin/scale", json={"prefill": 2}, headers=ADMIN, timeout=30)
    assert r.status_code == 202  # keeping (or shrinking) a size is always possible


def test_readiness_is_503_while_a_pool_has_no_live_node_and_health_stays_200(
    live: LiveCluster,
) -> None:
    cluster: Any = live.cluster
    health: list[tuple[int, dict[str, Any]]] = []
    stop = threading.Event()

    def probe_health() -> None:
        while not stop.is_set():
            r = httpx.get(f"{live.url}/health", timeout=10)
            health.append((r.status_code, r.json()))
            time.sleep(0.05)

    def ready() -> httpx.Response:
        return httpx.get(f"{live.url}/ready", timeout=10)

    assert ready().status_code == 200
    assert ready().json() == {"status": "ready"}  # no key: no node list
    r = httpx.get(f"{live.url}/ready", headers=ADMIN, timeout=10)
    assert r.json()["nodes"] == ["decode-0", "prefill-0", "prefill-2"]
    prober = threading.Thread(target=probe_health, daemon=True)
    prober.start()
    try:
        os.kill(cluster.client.membership.nodes["decode-0"].pid, signal.SIGKILL)
        killed = time.monotonic()
        _until(lambda: ready().status_code == 503, "/ready 503", HEARTBEAT_S + 10)
        to_503 = time.monotonic() - killed
        r = ready()
        assert r.status_code == 503 and r.json()["status"] == "unavailable", r.text
        assert r.json()["reason"].startswith("no live decode node"), r.text
        _until(lambda: ready().status_code == 200, "/ready 200 again", 150)
        back = time.monotonic() - killed
    finally:
        stop.set()
        prober.join(timeout=15)
    assert to_503 <= HEARTBEAT_S + 1.0, f"/ready said 503 {to_503:.1f} s after the kill"
    replacements = [n.node_id for n in cluster.pools.nodes() if n.is_replacement]
    assert replacements == ["decode-1"] and "decode-1" in cluster.client.membership.nodes
    assert health and all(h == (200, {"status": "ok"}) for h in health), health[:5]
    print(f"/ready: 503 {to_503:.2f} s after the kill, 200 again after {back:.1f} s")
    assert len(_generate(live)) == 4
