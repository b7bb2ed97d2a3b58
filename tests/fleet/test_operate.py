"""Operating a cluster from outside, on a Ray cluster of three raylets on this machine (a head
with no CPUs for actors, one raylet with a ``prefill`` resource, one with ``decode``), through
the real ``pd serve --address`` process and ``pd scale``, with the tiny random model:

1. nodes land on the raylet their role's resource names, and requests complete correctly;
2. under a steady stream of requests the pools go 1P1D -> 2P2D -> 1P1D (``pd scale``): every
   request gets the reference output, a warmed-up 2k-token prompt is a cache hit on the node
   that holds it, and the nodes that stay hold no slot, pair group or pair thread for the gone;
3. ``pd serve`` killed (SIGKILL) and started again attaches to the running nodes, and prompts
   cached before the restart are cache hits after it, on the nodes that hold them;
4. restarted once more with ``--autoscale``, the prefill pool grows while TTFT is over its
   target and shrinks back after the cooldown when idle, within its min and max.

The tests share the cluster and go in order (each starts from where the last one left the
pools). Every process started here is ended by its process group or through the cluster.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest

from pd.cli import main as pd_main
from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from tests.cluster.conftest import ServeProcess

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 8
_rng = random.Random(3)
PROMPTS = [[_rng.randrange(3, 40000) for _ in range(_rng.randrange(8, 40))] for _ in range(6)]
SYSTEM = [_rng.randrange(3, 40000) for _ in range(2048)]  # a 2k-token system prompt
CACHED = [[_rng.randrange(3, 40000) for _ in range(300)] for _ in range(2)]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


class RayCluster(NamedTuple):
    address: str
    raylet: dict[str, str]  # role -> the Ray node id of the raylet with that role's resource


class Server(ServeProcess):
    """``pd serve`` on the module's Ray cluster, and what these tests ask of it."""

    def __init__(self, args: list[str], log: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["PYTHONPATH"] = str(ROOT)
        super().__init__(args, log, env, timeout_s=240)

    def nodes(self) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/admin/nodes", timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def generate(
        self, prompt: list[int], max_tokens: int = MAX_TOKENS, **extra: Any
    ) -> dict[str, Any]:
        params = {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        body = {"input_ids": prompt, "sampling_params": params, **extra}
        r = httpx.post(f"{self.url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def warmup(self, prompts: list[list[int]], **extra: Any) -> list[dict[str, Any]]:
        body = {"prompts": prompts, **extra}
        r = httpx.post(f"{self.url}/admin/warmup", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["prompts"]

    def scale(self, **sizes: int) -> None:
        """``pd scale`` as a user runs it (it waits until the pools have these sizes)."""
        argv = ["scale", "--url", self.url, "--timeout", "240"]
        for role, n in sizes.items():
            argv += [f"--{role}", str(n)]
        assert pd_main(argv) == 0

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        found = re.search(rf"^{name}\{{{want}\}} (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0


class Load:
    """A steady stream of /generate requests from a few threads until ``stop()``."""

    def __init__(self, server: Server, num_threads: int = 2) -> None:
        self.outcomes: list[tuple[int, list[int] | str]] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(server, t), daemon=True)
            for t in range(num_threads)
        ]
        for t in self._threads:
            t.start()

    def _run(self, server: Server, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            i = rng.randrange(len(PROMPTS))
            try:
                self.outcomes.append((i, server.generate(PROMPTS[i])["output_ids"]))
            except (AssertionError, httpx.HTTPError) as e:
                self.outcomes.append((i, f"{type(e).__name__}: {e}"))

    def stop(self) -> list[tuple[int, list[int] | str]]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in self._threads), "a request hung"
        return self.outcomes


def _until(cond: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.2)


_INTEGRITY = """
import json, sys, ray
ray.init(address=sys.argv[1], namespace="pd", log_to_driver=False)
actors = {n: ray.get_actor(n) for n in ray.util.list_named_actors()}
print("REPORT", json.dumps({n: ray.get(a.check_integrity.remote()) for n, a in actors.items()}))
"""


def _integrity(address: str) -> dict[str, dict[str, int]]:
    """Every pd node's own slot and resource accounting (it asserts its invariants)."""
    out = subprocess.run(
        [sys.executable, "-c", _INTEGRITY, address],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split("REPORT ", 1)[1])


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    from ray.cluster_utils import Cluster

    small = {"num_cpus": 0, "object_store_memory": 80 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**small, "include_dashboard": False})
    try:
        prefill = cluster.add_node(resources={"prefill": 4}, **small)
        decode = cluster.add_node(resources={"decode": 4}, **small)
        yield RayCluster(cluster.address, {"prefill": prefill.node_id, "decode": decode.node_id})
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with 4096 positions (a 2k-token system prompt fits)."""
    out = tmp_path_factory.mktemp("tiny_long")
    for f in tiny_llama_dir.iterdir():
        shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return out


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    engine = Engine(EngineConfig(model=str(model_dir), max_total_tokens=4096))
    return [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def serve(ray_cluster: RayCluster, model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """``serve(*extra_flags) -> Server`` on the module's Ray cluster; ends them all at the end."""
    started: list[Server] = []
    logs = tmp_path_factory.mktemp("serve")

    def start(*extra: str) -> Server:
        args = ["--address", ray_cluster.address, "--model", str(model_dir)]
        args += ["--max-total-tokens", "16384", "--node-gpus", "0"]
        args += ["--prefill-resources", '{"prefill": 1}', "--decode-resources", '{"decode": 1}']
        # every request through a prefill node: these tests count pair groups and prefill hits
        args += ["--local-prefill-tokens", "-1"]
        started.append(Server([*args, *extra], logs / f"serve-{len(started)}.log"))
        return started[-1]

    yield start
    for server in started:
        server.end()


@pytest.fixture(scope="module")
def live(serve) -> dict[str, Server]:
    """The server the tests currently talk to (a test that restarts it puts the new one here)."""
    return {"server": serve()}


def _roles(pools: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    by_role: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": []}
    for node in pools["nodes"]:
        by_role[node["role"]].append(node)
    return by_role


def _check(outcomes: list[tuple[int, list[int] | str]], reference: list[list[int]]) -> None:
    assert outcomes, "no request ran"
    for i, out in outcomes:
        assert out == reference[i], (i, out)


def test_nodes_land_where_their_resources_say_and_requests_complete(
    live, ray_cluster, reference
) -> None:
    server = live["server"]
    pools = server.nodes()
    assert pools["target"] == {"prefill": 1, "decode": 1}
    for node in pools["nodes"]:
        assert node["state"] == "ready" and node["ray_node"] == ray_cluster.raylet[node["role"]]
    _check([(i, server.generate(p)["output_ids"]) for i, p in enumerate(PROMPTS)], reference)


def test_scale_up_and_down_under_load_with_a_warmed_up_system_prompt(
    live, ray_cluster, reference
) -> None:
    server = live["server"]
    # 1P1D after traffic: one pair group each; what a node of each role holds open with it
    base = {node_id.split("-")[0]: r for node_id, r in _integrity(ray_cluster.address).items()}
    assert base["prefill"]["pairs"] == base["decode"]["pairs"] == 1, base
    load = Load(server)
    _until(lambda: len(load.outcomes) >= 4, "requests before scaling")
    server.scale(prefill=2, decode=2)
    pools = _roles(server.nodes())
    assert [len(pools["prefill"]), len(pools["decode"])] == [2, 2]
    for role, nodes in pools.items():
        assert {n["ray_node"] for n in nodes} == {ray_cluster.raylet[role]}, nodes
    # threads besides the pair groups' (Ray's, the loop's, ...): the same before and after
    other_threads = {
        n: r["threads"] - r["pair_threads"] for n, r in _integrity(ray_cluster.address).items()
    }

    # the system prompt goes where the coordinator sends it; the first user turn hits it there
    (warm,) = server.warmup([SYSTEM])
    assert warm["num_tokens"] == len(SYSTEM) and warm["cached_tokens"] == 0
    holder = warm["node"]
    hits = server.metric("pd_node_cache_hit_tokens", node=holder)
    user = server.generate(SYSTEM + PROMPTS[0][:10], max_tokens=4)
    assert user["cached_tokens"] == len(SYSTEM), user

    def holder_hits() -> float:  # other requests hit too, but none by 2k tokens
        return server.metric("pd_node_cache_hit_tokens", node=holder) - hits

    _until(lambda: holder_hits() >= len(SYSTEM), "the hit counted on the holder", timeout=10)

    num_before = len(load.outcomes)
    server.scale(prefill=1, decode=1)
    _until(lambda: len(load.outcomes) >= num_before + 4, "requests after scaling down")
    _check(load.stop(), reference)
    pools = server.nodes()
    assert [n["state"] for n in pools["nodes"]] == ["ready", "ready"]

    # nothing is left of the nodes that went
    _until(lambda: all(n["load"] == 0 for n in server.nodes()["nodes"]), "idle")
    after = _integrity(ray_cluster.address)
    assert sorted(after) == sorted(n["id"] for n in pools["nodes"])
    for node_id, r in after.items():
        b = base[node_id.split("-")[0]]
        assert r["unfinished"] == r["in_use"] == r["transfers"] == 0, (node_id, r)
        assert r["free"] + r["cached"] == r["total"], (node_id, r)
        # one pair group (with the one peer left) and its sockets, as at the start; a worker
        # and (once it copied) a copier thread for it, and no other thread came or stayed
        assert (r["pairs"], r["sockets"]) == (1, b["sockets"]), (node_id, r, b)
        assert r["pair_threads"] <= 2 and r["threads"] - r["pair_threads"] == other_threads[
            node_id
        ], (node_id, r, other_threads)  # fmt: skip


def test_a_restarted_server_attaches_to_the_running_nodes_and_keeps_their_caches(
    live, serve
) -> None:
    server = live["server"]
    server.scale(prefill=2)
    # warmed up together, the two prompts go to the two prefill nodes (loads balance)
    placed = [w["node"] for w in server.warmup(CACHED)]
    assert sorted(placed) == sorted(n["id"] for n in _roles(server.nodes())["prefill"])
    ids = sorted(n["id"] for n in server.nodes()["nodes"])

    server.end(signal.SIGKILL)  # no goodbye: the nodes keep running, their requests orphaned
    live["server"] = server = serve()
    assert "attached to running nodes" in server.log.read_text()
    pools = server.nodes()
    assert sorted(n["id"] for n in pools["nodes"]) == ids
    assert pools["target"] == {"prefill": 2, "decode": 1}
    assert all(n["state"] == "ready" for n in pools["nodes"])
    # one after the other, each is routed back to the node that holds it, and hits there (with
    # no mirror of the caches both would go to the same idle node, one of them a miss)
    again = [server.warmup([prompt])[0] for prompt in CACHED]
    assert [w["node"] for w in again] == placed
    assert [w["cached_tokens"] for w in again] == [len(p) - 1 for p in CACHED]
    assert server.generate(CACHED[1] + [5, 6, 7])["cached_tokens"] >= len(CACHED[1]) - 1
    # a salted warm-up serves requests with that salt only (a namespace of its own)
    salted = PROMPTS[2] * 4
    assert server.warmup([salted], cache_salt="team-a")[0]["cached_tokens"] == 0
    assert server.generate(salted, cache_salt="team-a")["cached_tokens"] == len(salted) - 1
    assert server.generate(salted, cache_salt="team-b")["cached_tokens"] == 0


def test_the_autoscaler_grows_the_prefill_pool_under_load_and_shrinks_it_when_idle(
    live, serve, reference
) -> None:
    live["server"].end(signal.SIGINT)  # a clean exit leaves the nodes running too
    flags = ["--autoscale", "--autoscale-max-prefill", "2", "--autoscale-max-decode", "1"]
    flags += ["--ttft-slo", "0.01", "--autoscale-cooldown-s", "4", "--autoscale-interval-s", "0.5"]
    flags += ["--autoscale-window-s", "5"]
    live["server"] = server = serve(*flags)
    sizes: list[int] = []

    def prefill_size() -> int:
        sizes.append(server.nodes()["target"]["prefill"])
        return sizes[-1]

    _until(lambda: prefill_size() == 1, "idle: back to the min", timeout=60)  # was 2
    load = Load(server, num_threads=3)
    _until(lambda: prefill_size() == 2, "TTFT over target: +1 prefill", timeout=90)
    _until(lambda: len(_roles(server.nodes())["prefill"]) == 2, "the new node", timeout=90)
    _check(load.stop(), reference)
    _until(lambda: prefill_size() == 1, "idle after the cooldown: back to the min", timeout=60)
    assert set(sizes) <= {1, 2}
    grown = server.metric(
        "pd_autoscaler_decisions_total", pool="prefill", reason="ttft_above_target"
    )
    assert (
        grown >= 1
        and server.metric("pd_autoscaler_decisions_total", pool="prefill", reason="idle") >= 2
    )
    assert server.metric("pd_autoscaler_desired", pool="decode") == 1
    assert server.nodes()["target"] == {"prefill": 1, "decode": 1}
