"""How long a node takes to start: an engine built in a fresh process, and a local cluster
(Ray already up) from ``Cluster.start()`` to every node registered, for each topology; and a
node restarted on the same machine: a fresh process at ``pd serve``'s engine defaults (compiled
decode steps) from its launch to the first token of its first request, with the compiled-step
cache empty (cold: it compiles) and then again on the cache that run left (warm: it loads),
in the same run, each in a new cache directory (``--restarts 0`` skips it).

Each measurement runs in its own process (imports cold, as a new node's are), ``--repeats``
times; the medians are printed beside ``import torch`` in a fresh process, the floor that every
node pays and this code cannot change. To compare two versions of pd, run it with each on
``PYTHONPATH`` (a worktree of the other commit), one after the other:

    python scripts/bench_startup.py [--model DIR] [--topologies 1p1d,3p1d] [--repeats 3] \
        [--restarts 1]
    PYTHONPATH=/path/to/other/checkout python scripts/bench_startup.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

_IMPORT_TORCH = "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)"

_ENGINE = """
import sys, time
import torch
from pd.executor.config import EngineConfig
from pd.engine.engine import Engine
t = time.perf_counter()
Engine(EngineConfig(model=sys.argv[1] or None, max_total_tokens=8192, num_threads=1))
print(time.perf_counter() - t)
"""

_CLUSTER = """
import sys, time
import ray
ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=80 * 2**20,
         log_to_driver=False)
from pd.router.policy import CoordinatorConfig
from pd.fleet.config import ClusterConfig
from pd.fleet.launcher import Cluster
from pd.executor.config import EngineConfig
cfg = EngineConfig(model=sys.argv[1] or None, max_total_tokens=8192, max_running_requests=48)
cluster = Cluster(cfg, ClusterConfig(num_prefill=int(sys.argv[2]), num_decode=int(sys.argv[3]),
                  threads_per_node=1), CoordinatorConfig())
t = time.perf_counter()
cluster.start()
print(time.perf_counter() - t)
cluster.shutdown()
"""


_FIRST_TOKEN = """
import sys, time
from pd.cli import SERVE_ENGINE_DEFAULTS
from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
cfg = EngineConfig(model=sys.argv[1] or None, max_total_tokens=8192, compile_cache=sys.argv[2],
                   **SERVE_ENGINE_DEFAULTS)
engine = Engine(cfg)
engine.generate([[1, 2, 3, 4, 5, 6, 7, 8]], SamplingParams(max_tokens=1, temperature=0.0))
done = time.time()
graphs = engine.runner.graphs
print(f"buckets {sorted(graphs.compile_seconds)} loaded {sorted(graphs.loaded)}", file=sys.stderr)
print(done)
"""


def _restart_seconds(model: str, cache: str) -> float:
    """Seconds from launching a fresh process to its engine's first token (``_FIRST_TOKEN``)."""
    t0 = time.time()
    done = subprocess.run(
        [sys.executable, "-c", _FIRST_TOKEN, model, cache],
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    print(f"  {done.stderr.strip().splitlines()[-1]}")
    return float(done.stdout.strip().splitlines()[-1]) - t0


def _restarts(model: str, repeats: int) -> dict[str, float]:
    """Cold then warm starts on one new compiled-step cache, ``repeats`` times; -> medians."""
    cold, warm = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="pd-bench-compiled-") as cache:
            cold.append(_restart_seconds(model, cache))
            warm.append(_restart_seconds(model, cache))
    rows = {
        "node restart -> first token, cold compiled-step cache": statistics.median(cold),
        "node restart -> first token, warm compiled-step cache": statistics.median(warm),
    }
    for label, samples in zip(rows, (cold, warm), strict=True):
        print(f"{label}: median {rows[label]:.2f} s of {[round(s, 2) for s in samples]}")
    print(f"cold / warm: {rows[next(iter(rows))] / statistics.median(warm):.1f}x")
    return rows


def _seconds(code: str, *args: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return float(done.stdout.strip().splitlines()[-1])


def _topology(spec: str) -> tuple[int, int]:
    prefill, _, decode = spec.lower().removesuffix("d").partition("p")
    return int(prefill), int(decode)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="", help="a model dir (default: SmolLM2)")
    p.add_argument("--topologies", default="1p1d,3p1d", help="clusters to start, e.g. 1p1d,3p1d")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--restarts", type=int, default=1, help="cold + warm restarts (each a new cache); 0: none"
    )
    args = p.parse_args()
    topologies = [_topology(t) for t in args.topologies.split(",") if t.strip()]

    rows: dict[str, float] = {}
    runs = {
        "import torch (fresh process)": (_IMPORT_TORCH,),
        "engine built (fresh process)": (_ENGINE, args.model),
        **{
            f"cluster {p}P{d}D started": (_CLUSTER, args.model, str(p), str(d))
            for p, d in topologies
        },
    }
    for label, (code, *rest) in runs.items():
        samples = [_seconds(code, *rest) for _ in range(args.repeats)]
        rows[label] = statistics.median(samples)
        print(f"{label}: median {rows[label]:.2f} s of {[round(s, 2) for s in samples]}")
    if args.restarts:
        rows.update(_restarts(args.model, args.restarts))
    print(json.dumps({k: round(v, 3) for k, v in rows.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
