"""Prefill and decode nodes of different tensor-parallel sizes on a live Ray cluster (the kv3
tiny model: SmolLM2's 9 heads over 3 KV heads, which a TP-2 node splits 1 and 2 over its
ranks; real rank processes over gloo): for each pair (p, d) of sizes in
{1, 2}² but (1, 1) (every other cluster test), greedy answers at fp32 equal HF's, cold and on
a cache hit (the decode node's own prefix: only the rest moves), 16 at once as one at a time;
KV leaves and enters a node through its rank 0's staging pool (``pd.parallel.rank_kv``)."""

from __future__ import annotations

import os
import signal
import time
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
HEARTBEAT_S = 4.0


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
def live(request: pytest.FixtureRequest, tiny_kv3_dir: Path, ray_session: None) -> Iterator[Any]:
    p, d = request.param
    engine = {"quantization": "none", "max_total_tokens": 2048, "compile_buckets": "off"}
    live, stop = start_live_cluster(
        1,
        1,
        model=str(tiny_kv3_dir),
        engine_kwargs=engine,
        prefill_tensor_parallel_size=p,
        decode_tensor_parallel_size=d,
    )
    try:
        yield live
    finally:
        stop()  # type: ignore[operator]


def test_answers_equal_hf_cold_warm_and_sixteen_at_once(live: LiveCluster, tiny_kv3_dir) -> None:
    system = _prompt(40, 7)
    prompts = [system + _prompt(3 + i % 5, 100 + i) for i in range(16)]
    expected = [hf_greedy(tiny_kv3_dir, p, MAX_TOKENS, ignore_eos=True) for p in prompts]
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
        tiny_kv3_dir, turn2, MAX_TOKENS, ignore_eos=True
    )
    wait_idle_and_check(live)


def _ranks(node_pid: int) -> list[int]:
    """The rank processes (children) of a node's actor process."""
    kids: list[int] = []
    for task in Path(f"/proc/{node_pid}/task").iterdir():
        kids += [int(p) for p in (task / "children").read_text().split()]
    return kids


@pytest.fixture(scope="module")
def faulty(tiny_kv3_dir: Path, ray_session: None) -> Iterator[Any]:
    from pd.cluster.client_config import ClientConfig

    engine = {"max_total_tokens": 2048, "compile_buckets": "off"}
    live, stop = start_live_cluster(
        1,
        1,
        model=str(tiny_kv3_dir),
        engine_kwargs=engine,
        policy="round_robin",
        client=ClientConfig(heartbeat_timeout_s=HEARTBEAT_S, request_timeout_s=90.0),
        prefill_tensor_parallel_size=2,
        decode_tensor_parallel_size=2,
    )
    try:
        yield live
    finally:
        stop()  # type: ignore[operator]


@pytest.mark.parametrize("fault", ["kill-decode-rank", "freeze-prefill-rank"])
def test_a_rank_killed_or_frozen_takes_its_node_down_as_one(faulty, tiny_kv3_dir, fault) -> None:
    """Rank 1 of the TP-2 decode node killed (its node exits at its next step), or rank 1 of
    the TP-2 prefill node frozen (its node stops in a sum and misses its heartbeats), under a
    steady stream of requests: every answer is HF's (a stream that had started on the dead
    decode node resumes on its replacement); the node is replaced; afterwards nothing is held
    anywhere, and no rank of the dead node is left."""
    from tests.cluster.test_faults import Load, _check, _wait

    client = faulty.cluster.client
    role = "decode" if fault.startswith("kill") else "prefill"
    (victim,) = [n for n, i in client.membership.nodes.items() if i.role == role]
    pid = client.membership.nodes[victim].pid
    ranks = _ranks(pid)
    assert len(ranks) == 1, ranks
    reference = _reference(tiny_kv3_dir)
    load = Load(faulty.url)
    time.sleep(1.0)
    os.kill(ranks[0], signal.SIGKILL if fault.startswith("kill") else signal.SIGSTOP)
    _wait(
        lambda: victim in client.membership.dead_nodes,
        f"{victim} found dead",
        timeout=3 * HEARTBEAT_S,
    )
    _wait(
        lambda: len([n for n, i in client.membership.nodes.items() if i.role == role]) == 1,
        "replaced",
    )
    time.sleep(1.0)
    outcomes = load.stop()
    _check(outcomes, reference)
    assert sum(o.error is None for o in outcomes) >= 2
    _wait(lambda: not any(_alive(p) for p in (pid, *ranks)), "the dead node's processes gone")
    wait_idle_and_check(faulty, timeout_s=30)


def _reference(model_dir: Path) -> list[list[int]]:
    from tests.cluster.test_faults import MAX_TOKENS as N
    from tests.cluster.test_faults import PROMPTS

    return [hf_greedy(model_dir, p, N, ignore_eos=True) for p in PROMPTS]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"
