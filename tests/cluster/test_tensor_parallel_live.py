"""Prefill and decode nodes of different tensor-parallel sizes on a live Ray cluster (the tiny
model: 4 heads, 2 KV heads; real rank processes over gloo): for each pair (p, d) of sizes in
{1, 2}² but (1, 1) (every other cluster test), greedy answers at fp32 equal HF's, cold and on
a cache hit (the decode node's own prefix: only the rest moves), 16 at once as one at a time;
KV leaves and enters a node through its rank 0's staging pool (``pd.engine.rank_kv``)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.cluster.conftest import LiveCluster, start_live_cluster, wait_idle_and_check
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.timeout(600)
MAX_TOKENS = 8


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(live: LiveCluster, ids: list[int]) -> dict[str, Any]:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
    }
    r = httpx.post(f"{live.url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module", params=[(2, 1), (1, 2), (2, 2)], ids=lambda p: f"p{p[0]}d{p[1]}")
def live(request: pytest.FixtureRequest, tiny_llama_dir: Path, ray_session: None) -> Iterator[Any]:
    p, d = request.param
    engine = {"quantization": "none", "max_total_tokens": 2048, "compile_buckets": "off"}
    live, stop = start_live_cluster(
        1,
        1,
        model=str(tiny_llama_dir),
        engine_kwargs=engine,
        prefill_tensor_parallel_size=p,
        decode_tensor_parallel_size=d,
    )
    try:
        yield live
    finally:
        stop()  # type: ignore[operator]


def test_answers_equal_hf_cold_warm_and_sixteen_at_once(live: LiveCluster, tiny_llama_dir) -> None:
    system = _prompt(40, 7)
    prompts = [system + _prompt(3 + i % 5, 100 + i) for i in range(16)]
    expected = [hf_greedy(tiny_llama_dir, p, MAX_TOKENS, ignore_eos=True) for p in prompts]
    cold = _generate(live, prompts[0])
    assert cold["output_ids"] == expected[0]
    with ThreadPoolExecutor(16) as pool:
        at_once = list(pool.map(lambda p: _generate(live, p), prompts))
    assert [a["output_ids"] for a in at_once] == expected
    warm = _generate(live, prompts[0])  # the whole prompt cached now
    assert warm["cached_tokens"] >= len(prompts[0]) - 1
    assert warm["output_ids"] == expected[0]
    turn2 = prompts[0] + warm["output_ids"] + _prompt(4, 999)  # a conversation's next turn
    assert _generate(live, turn2)["output_ids"] == hf_greedy(
        tiny_llama_dir, turn2, MAX_TOKENS, ignore_eos=True
    )
    wait_idle_and_check(live)
