"""Tensor parallel on this machine: a node of N ranks beside one of 1, in the same run.

1. The sum over ranks (``TPGroup.all_reduce``, gloo on the CPU): microseconds per call for a
   decode row, a batch of 32 rows and a 512-token prefill chunk, deterministic (gather, then
   add in rank order) and torch's all-reduce.
2. The engine: prefill tokens/s of a 512-token prompt and decode tokens/s at batch 1 and 8,
   for each ``--tp`` size (SmolLM2-135M has 9 heads over 3 KV heads: sizes 1, 2 (its KV heads
   split 1 and 2) and 3). On a 2-core CPU the ranks share the cores: this measures the overhead of the plan
   and the sums, not a speed-up, so a GPU run knows what the extra steps cost.
3. A transfer between nodes of different sizes: KV leaves a TP node through rank 0's staging
   pool (``mirror``: its ranks' heads gathered after the forward) and enters one through it
   (``deliver``: scattered to the ranks); the pair transfer between the two rank 0s is the
   same-TP transfer's. Measured for a 2,048-token prompt of the model at the largest ``--tp``,
   beside the same-TP pair transfer of the same bytes (``bench_transfer.py``'s, in this run).
4. Capacity: the weight bytes each rank of a node of N holds (the sharding pd applies) for
   Llama-3 shapes, and the largest that fits a device of ``--device-gib`` with a fifth left for
   the KV pool.

    python scripts/bench_tp.py [--model PATH] [--tp 1,2,3] [--threads 2] [--device-gib 80]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time

import torch
from bench_attention import _cpu_name
from bench_engine import _best, pd_decode, pd_prefill

from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from pd.model.config import ModelConfig
from pd.model.loader import load_config, resolve_model
from pd.model.sharding import shard_config
from pd.parallel.group import TPGroup

HIDDEN = 576  # SmolLM2-135M's
ROWS = (1, 32, 512)
CALLS = 200

# Llama-3 8B and 70B (their config.json's numbers), for the capacity table
LLAMA3 = {
    "Llama-3-8B": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                       num_kv_heads=8, vocab_size=128256),
    "Llama-3-70B": dict(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                        num_kv_heads=8, vocab_size=128256),
}  # fmt: skip


def _sum_loop(rank: int, store: str, deterministic: bool, out: mp.Queue | None) -> None:
    torch.set_num_threads(1)
    group = TPGroup(rank, 2, store, torch.device("cpu"), 30.0, deterministic)
    timings = {}
    for rows in ROWS:
        x = torch.randn(rows, HIDDEN)
        for _ in range(10):
            group.all_reduce(x)
        t0 = time.perf_counter()
        for _ in range(CALLS):
            group.all_reduce(x)
        timings[rows] = (time.perf_counter() - t0) / CALLS * 1e6
    group.close()
    if out is not None:
        out.put(timings)


def bench_sums(deterministic: bool) -> dict[int, float]:
    """Microseconds per sum over 2 ranks (two processes, as a node's ranks are)."""
    store = tempfile.mkdtemp(prefix="pd-bench-tp-")
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    peer = ctx.Process(target=_sum_loop, args=(1, store, deterministic, None))
    peer.start()
    _sum_loop(0, store, deterministic, q)
    peer.join()
    return q.get()


def bench_engine(model: str | None, tp: int, threads: int) -> tuple[float, float, float]:
    engine = Engine(
        EngineConfig(
            model=model,
            dtype="float32",
            max_total_tokens=8192,
            num_threads=threads,
            tensor_parallel_size=tp,
            host_cache_tokens=0,
            enable_prefix_cache=False,
        )
    )
    try:
        prefill = pd_prefill(engine, 512, 3)
        return prefill, pd_decode(engine, 1, 128, 32), pd_decode(engine, 8, 128, 32)
    finally:
        engine.close()


def bench_staging(model: str | None, tp: int, threads: int, tokens: int) -> tuple[float, float]:
    """Seconds to mirror and to deliver ``tokens`` slots on a TP-``tp`` node."""
    from pd.executor.runner import ModelRunner
    from pd.parallel.ranks import RankLink

    cfg = EngineConfig(
        model=model, dtype="float32", max_total_tokens=tokens + 64, num_threads=threads,
        tensor_parallel_size=tp, host_cache_tokens=0,
    )  # fmt: skip
    link = RankLink(cfg, staged=True)
    runner = ModelRunner(cfg, ranks=link)
    try:
        staging = link.staging
        assert staging is not None
        slots = list(range(tokens))
        mirror = _best(lambda: staging.mirror(slots), 3)
        deliver = _best(lambda: staging.deliver(slots), 3)
        return mirror, deliver
    finally:
        runner.close()


def bench_pair(tokens: int, heads: int, layers: int, head_dim: int) -> float:
    """Seconds of the same-TP pair transfer of ``tokens`` slots (prefill done -> decode can
    start), ``bench_transfer.py``'s measurement."""
    import bench_transfer

    args = argparse.Namespace(
        tokens=tokens, iters=3, backend="gloo", layers=layers, heads=heads, head_dim=head_dim,
        poll_ms=1.0,
    )  # fmt: skip
    return bench_transfer.bench_transfer(args, False, False)["ready"]


def capacity(device_gib: float) -> list[str]:
    lines = []
    for name, dims in LLAMA3.items():
        mc = ModelConfig(
            architecture="LlamaForCausalLM", head_dim=128, rms_norm_eps=1e-5, rope_theta=5e5,
            max_position_embeddings=8192, tie_word_embeddings=False, attention_bias=False, **dims,
        )  # fmt: skip
        cells = []
        for n in (1, 2, 4, 8):
            sc = shard_config(mc, n)
            h, d = sc.hidden_size, sc.head_dim
            per_layer = h * (sc.num_heads + 2 * sc.num_kv_heads) * d + sc.num_heads * d * h
            per_layer += 3 * h * sc.intermediate_size
            params = sc.num_layers * per_layer + 2 * sc.vocab_size * h  # embedding, head whole
            gib = 2 * params / 2**30  # bf16
            fits = "fits" if gib <= 0.8 * device_gib else "no"
            cells.append(f"TP{n} {gib:6.1f} GiB ({fits})")
        lines.append(f"{name:12s} " + "  ".join(cells))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--tp", default="1,2,3", help="sizes to compare (the first is the baseline)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per node (split)")
    ap.add_argument("--device-gib", type=float, default=80.0)
    args = ap.parse_args()
    print(f"cpu={_cpu_name()} threads={args.threads} fp32 date={time.strftime('%Y-%m-%d')}")
    print("\nsum over 2 ranks (gloo, loopback), microseconds per call:")
    print(f"{'rows x 576':>12s} {'deterministic':>14s} {'all-reduce':>11s}")
    det, plain = bench_sums(True), bench_sums(False)
    for rows in ROWS:
        print(f"{rows:12d} {det[rows]:14.0f} {plain[rows]:11.0f}")
    sizes = [int(s) for s in args.tp.split(",")]
    print("\nengine, fp32 (ratio: to the first size):")
    print(
        f"{'tp':>3s} {'prefill 512 tok/s':>18s} {'decode b1 tok/s':>16s} {'decode b8 tok/s':>16s}"
    )
    base = None
    for tp in sizes:
        row = bench_engine(args.model, tp, args.threads)
        base = base or row
        cells = [f"{v:8.1f} ({v / b:4.2f}x)" for v, b in zip(row, base)]
        print(f"{tp:3d} {cells[0]:>18s} {cells[1]:>16s} {cells[2]:>16s}")
    pd_cfg = ModelConfig.from_hf(load_config(resolve_model(args.model)))
    pair = bench_pair(2048, pd_cfg.num_kv_heads, pd_cfg.num_layers, pd_cfg.head_dim)
    rows = [("1 -> 1 (pair transfer)", 0.0)]
    # every head of every layer's K and V, fp32
    mb = 2048 * pd_cfg.num_layers * 2 * pd_cfg.num_kv_heads * pd_cfg.head_dim * 4 / 1e6
    for tp in (s for s in sizes if s > 1):
        mirror, deliver = bench_staging(args.model, tp, args.threads, 2048)
        rows += [
            (f"{tp} -> 1 (+ mirror)", mirror),
            (f"1 -> {tp} (+ deliver)", deliver),
            (f"{tp} -> {tp} (+ both)", mirror + deliver),
        ]
    print(f"\nKV of 2,048 tokens ({mb:.0f} MB, fp32): prefill done -> decode can start")
    print(f"{'prefill TP -> decode TP':>24s} {'ms':>8s} {'MB/s':>7s} {'vs same TP':>10s}")
    for name, extra in rows:
        sec = pair + extra
        print(f"{name:>24s} {1e3 * sec:8.1f} {mb / sec:7.0f} {pair / sec:9.2f}x")
    print(
        f"\ncapacity: bf16 weight bytes per rank; 'fits' leaves a fifth of {args.device_gib:g} GiB"
    )
    print("for the KV pool")
    for line in capacity(args.device_gib):
        print(line)


if __name__ == "__main__":
    main()
