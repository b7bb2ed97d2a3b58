"""Two engine processes sharing the cores, as a CPU cluster's prefill and decode nodes do, and how
long their idle OpenMP threads spin (``GOMP_SPINCOUNT``) decides how fast both go.

One process prefills a 256-token prompt over and over, resting as long as each prefill took
(busy half the time, like a prefill node under the chat load); the other decodes a batch of 4
without pause. Both run for ``--seconds`` at each spin count, libgomp's default (300,000, the
baseline) first (``P/D``: the prefill process's count, then the decode process's), and
each alone at the first and last count for reference.

    python scripts/bench_shared_cores.py [--seconds 20] [--threads 2] \
        [--spin-counts 300000,1000,1000/300000,0] [--quantization int4] [--compile-buckets 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PREFILL_TOKENS = 256
DECODE_BATCH = 4


def child(args: argparse.Namespace) -> None:
    """One role's loop; prints its timings as one JSON line."""
    import torch
    from bench_engine import _prompts

    from pd.core.batch import SeqInput
    from pd.core.kv_pool import SlotAllocator
    from pd.core.sampling_params import SamplingParams
    from pd.engine.engine import Engine
    from pd.executor.config import EngineConfig

    torch.set_num_threads(args.threads)
    engine = Engine(
        EngineConfig(
            model=args.model,
            max_model_len=8192,
            max_total_tokens=40000,
            max_running_requests=16,
            enable_prefix_cache=False,
            quantization=args.quantization,
            compile_buckets=args.compile_buckets if args.role == "decode" else "off",
        )
    )
    vocab = engine.runner.model_config.vocab_size
    if args.role == "prefill":
        runner = engine.runner
        slots = SlotAllocator(runner.pool.num_slots, 1).allocate(PREFILL_TOKENS)
        prompt = _prompts(1, PREFILL_TOKENS, vocab)[0]

        def run() -> float:
            t0 = time.perf_counter()
            runner.forward([SeqInput(prompt, slots, 0)])
            took = time.perf_counter() - t0
            time.sleep(took)  # busy half the time
            return took
    else:
        params = SamplingParams(max_tokens=8000, temperature=0.0, ignore_eos=True)
        for p in _prompts(DECODE_BATCH, 128, vocab):
            engine.add_request(p, params)
        while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()

        def run() -> float:
            t0 = time.perf_counter()
            engine.step()
            return time.perf_counter() - t0

    run()  # warm-up
    barrier = Path(args.barrier)
    (barrier / args.role).touch()
    while len(list(barrier.iterdir())) < args.peers:
        time.sleep(0.01)
    times, end = [], time.monotonic() + args.seconds
    while time.monotonic() < end:
        times.append(run())
    print(json.dumps({"median_ms": statistics.median(times) * 1e3, "count": len(times)}))


def measure(args: argparse.Namespace, spin: str, roles: list[str]) -> dict[str, dict]:
    """Run ``roles`` side by side at one spin count (``P/D``: the prefill process's, then the
    decode process's); their results by role."""
    parts = spin.split("/")
    counts = {"prefill": parts[0], "decode": parts[-1]}
    path = str(Path(__file__).parent)
    with tempfile.TemporaryDirectory() as barrier:
        procs = {
            role: subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--role",
                    role,
                    "--barrier",
                    barrier,
                    "--peers",
                    str(len(roles)),
                    *sys.argv[1:],
                ],
                env=dict(os.environ, GOMP_SPINCOUNT=counts[role], PYTHONPATH=path),
                stdout=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for role in roles
        }
        out = {role: p.communicate(timeout=args.seconds + 600)[0] for role, p in procs.items()}
    for role, p in procs.items():
        if p.returncode:
            raise SystemExit(f"{role} at GOMP_SPINCOUNT={spin} exited with {p.returncode}")
    return {role: json.loads(text.strip().splitlines()[-1]) for role, text in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each process")
    ap.add_argument(
        "--spin-counts",
        default="300000,1000,1000/300000,0",
        help="the first is the baseline; P/D: the prefill process's, the decode process's",
    )
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--compile-buckets", default="4", help="the decode process's")
    ap.add_argument("--role", choices=("prefill", "decode"), help=argparse.SUPPRESS)
    ap.add_argument("--barrier", help=argparse.SUPPRESS)
    ap.add_argument("--peers", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        return child(args)
    spins = args.spin_counts.split(",")
    rows = []
    for spin in spins:
        rows.append((spin, "side by side", measure(args, spin, ["prefill", "decode"])))
    for spin in dict.fromkeys((spins[0], spins[-1])):
        alone = {role: measure(args, spin, [role])[role] for role in ("prefill", "decode")}
        rows.append((spin, "each alone", alone))
    base = rows[0][2]
    base_steps = base["decode"]["count"] / args.seconds
    print(
        f"threads={args.threads} each, quantization={args.quantization}, decode steps compiled "
        f"for {args.compile_buckets}, {args.seconds:g} s a row, {os.cpu_count()} cores\n"
    )
    print(
        f"| GOMP_SPINCOUNT | processes | prefill {PREFILL_TOKENS} tokens, median ms | "
        f"vs baseline | decode steps/s (batch {DECODE_BATCH}) | vs baseline |"
    )
    print("|---:|---|---:|---:|---:|---:|")
    for spin, how, res in rows:
        steps = res["decode"]["count"] / args.seconds
        print(
            f"| {spin} | {how} | {res['prefill']['median_ms']:.0f} | "
            f"{base['prefill']['median_ms'] / res['prefill']['median_ms']:.2f}× | "
            f"{steps:.1f} | {steps / base_steps:.2f}× |"
        )


if __name__ == "__main__":
    main()
