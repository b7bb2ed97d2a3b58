"""How long a node takes to start: an engine built in a fresh process, and a local cluster
(Ray already up) from ``Cluster.start()`` to every node registered, for each topology.

Each measurement runs in its own process (imports cold, as a new node's are), ``--repeats``
times; the medians are printed beside ``import torch`` in a fresh process, the floor that every
node pays and this code cannot change. To compare two versions of pd, run it with each on
``PYTHONPATH`` (a worktree of the other commit), one after the other:

    python scripts/bench_startup.py [--model DIR] [--topologies 1p1d,3p1d] [--repeats 3]
    PYTHONPATH=/path/to/other/checkout python scripts/bench_startup.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

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
    print(json.dumps({k: round(v, 3) for k, v in rows.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
