"""Tenant A's hot prefix while tenant B floods: global LRU against fair eviction, one run.

Through the real colocated Engine (SmolLM2-135M by default, greedy, one token out): each round,
A sends its hot system prompt and a new question, then B sends unique long prompts that fill
the device pool again (``pdtools.tenant_flood``; the host tier off, so an evicted prefix is
gone). Printed per eviction policy: A's hot-prefix hit rate (rounds after the first), the
cached tokens of each of A's requests, the tokens the pool evicted, and the wall time.

    python scripts/bench_tenants.py [--model M] [--pool 4096] [--hot 512] [--flood 1024]
                                    [--flood-per-round 4] [--rounds 5] [--num-threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_attention import _cpu_name  # scripts/ is on the path when run as a script

from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from pdtools.tenant_flood import FloodShape, run_flood


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--pool", type=int, default=4096, help="device KV slots")
    ap.add_argument("--hot", type=int, default=512, help="tokens of A's hot prefix")
    ap.add_argument("--question", type=int, default=32, help="tokens of A's question")
    ap.add_argument("--flood", type=int, default=1024, help="tokens of each of B's prompts")
    ap.add_argument("--flood-per-round", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--num-threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.num_threads)
    shape = FloodShape(args.hot, args.question, args.flood, args.flood_per_round, args.rounds)
    print(f"cpu: {_cpu_name()}, {args.num_threads} threads; {shape}, pool {args.pool}")
    print("| eviction | A's hot-prefix hit rate | A's cached tokens per round | evicted | s |")
    print("|---|---:|---|---:|---:|")
    for eviction in ("lru", "fair"):
        cfg = EngineConfig(
            model=args.model,
            max_total_tokens=args.pool,
            host_cache_tokens=0,
            cache_eviction=eviction,
            num_threads=args.num_threads,
        )
        engine = Engine(cfg)
        t0 = time.perf_counter()
        r = run_flood(engine, shape)
        seconds = time.perf_counter() - t0
        engine.check_integrity()
        cached = ", ".join(map(str, r.a_cached))
        print(
            f"| {eviction} | {r.a_hit_rate:.1%} | {cached} | {r.num_evicted_tokens:,} "
            f"| {seconds:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
