"""The disk tier on a real cluster (Ray, 1 prefill + 1 decode node of the tiny model, one
thread each, every request through the prefill node): a prefix reused on the prefill node is
written through to the disk directory; the node is killed (SIGKILL), its replacement starts on
the same host and directory, reads the prefix up and announces it, and the first request for it
hits there and answers as before; with the default KV and with ``--kv-cache-dtype int8`` (its
chunks are codes and scales)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cluster.conftest import LiveCluster, start_live_cluster, wait_idle_and_check

pytestmark = pytest.mark.timeout(420)
PREFIX = [(7 * i) % 500 + 3 for i in range(300)]  # 4 whole 64-token chunks and a tail


@pytest.fixture(scope="module", params=["auto", "int8"])
def kv_cache_dtype(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory, kv_cache_dtype: str) -> Path:
    return tmp_path_factory.mktemp(f"kv-disk-{kv_cache_dtype}")


@pytest.fixture(scope="module")
def live(
    ray_session: None, tiny_llama_dir: Path, disk: Path, kv_cache_dtype: str
) -> Iterator[LiveCluster]:
    engine = {
        "disk_cache_dir": str(disk),
        "max_total_tokens": 2048,
        "kv_cache_dtype": kv_cache_dtype,
    }
    live, stop = start_live_cluster(1, 1, model=str(tiny_llama_dir), engine_kwargs=engine)
    try:
        yield live
    finally:
        stop()  # type: ignore[operator]


def _generate(live: LiveCluster, ids: list[int]) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}}
    r = httpx.post(f"{live.url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_replaced_prefill_node_finds_the_prefix_its_predecessor_reused(
    live: LiveCluster, disk: Path
) -> None:
    cluster: Any = live.cluster
    first = _generate(live, PREFIX + [11])
    again = _generate(live, PREFIX + [12])  # reused: its chunks written through to disk
    assert again["cached_tokens"] >= 256, again
    expected = _generate(live, PREFIX + [13])["output_ids"]
    assert first["output_ids"] and expected
    wait_idle_and_check(live)
    deadline = time.monotonic() + 30  # the node's disk writer: its 4 chunks of the prefix
    while len(list(disk.glob("*/*.kv"))) < 4:
        assert time.monotonic() < deadline, "the prefix's chunks were not written in 30 s"
        time.sleep(0.2)
    os.kill(cluster.client.membership.nodes["prefill-0"].pid, signal.SIGKILL)
    deadline = time.monotonic() + 180
    while "prefill-1" not in cluster.client.membership.nodes:
        assert time.monotonic() < deadline, "no replacement prefill node within 180 s"
        time.sleep(0.2)
    deadline = time.monotonic() + 30  # its first stats: what it read up from disk
    while not cluster.client.membership.node_stats.get("prefill-1"):
        assert time.monotonic() < deadline, "no stats from the replacement within 30 s"
        time.sleep(0.2)
    stats = cluster.client.membership.node_stats["prefill-1"]
    assert stats.num_host_cached_tokens >= 256, stats
    after = _generate(live, PREFIX + [13])
    assert after["output_ids"] == expected
    assert after["cached_tokens"] >= 256, after
    stats = cluster.client.membership.node_stats["prefill-1"]
    assert stats.num_disk_rejected == 0
    wait_idle_and_check(live)
