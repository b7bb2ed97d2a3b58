"""The cost of deterministic inference: the engine at ``pd serve``'s defaults (int4 weights and
compiled decode steps on a CPU), deterministic (the default) beside ``--no-deterministic`` (the
numerics before it: long prefill chunks by a bf16 copy of the weights and SDPA), in one process,
measured in alternating rounds (medians).

Prefill: one cold prompt of N tokens in one forward (a request's time to first token, unloaded).
Decode: B requests of 128-token prompts stepping together (tokens/s; batches of 1, 2 and 4 run
in compiled steps, larger ones eagerly).

GEMMs (``--gemm``, or ``--only-gemm``): how close pd's own matmuls come to the machine, in
one run: prefill GEMM FLOP/s of each deterministic kernel on the default model's shapes beside
the best this CPU reaches (oneDNN's bf16 GEMM, on AMX where the CPU has it, at the same shapes),
and a decode step's matmuls at batch 1 beside the weight-streaming bound (the weights' bytes /
the memory bandwidth of a large copy measured in the same run).

    python scripts/bench_deterministic.py [--rounds 3] [--threads 2] [--quantization auto]
        [--gemm | --only-gemm]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from pd.core import envs
from pd.core.batch import SeqInput
from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig

PREFILL_LENS = (128, 512, 2048)
DECODE_BATCHES = (1, 4, 16)


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(100, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_ms(engine: Engine, n: int) -> float:
    runner = engine.runner
    prompt = _prompt(n, runner.model_config.vocab_size, n)
    t0 = time.perf_counter()
    runner.forward([SeqInput(prompt, list(range(n)), 0)])
    return 1e3 * (time.perf_counter() - t0)


def decode_tokens_per_s(engine: Engine, batch: int, steps: int = 32) -> float:
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(_prompt(128, engine.runner.model_config.vocab_size, 1000 + i), params)
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = time.perf_counter() - t0
    assert not engine.has_unfinished
    return batch * steps / dt


# SmolLM2-135M's linears (in, out): q/k/v/o, gate/up fused, down
GEMM_SHAPES = ((576, 576), (576, 192), (576, 3072), (1536, 576))


def _best_s(f, n: int = 15) -> float:
    f()
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def _run_all(layers, xs) -> None:
    for f, x in zip(layers, xs):
        f(x)


def gemm_table(threads: int) -> None:
    """Print the GEMM and weight-streaming tables (the module's docstring)."""
    from torch import nn

    from pd.model.quant import OneDNNLinear, quantize_linears

    torch.set_num_threads(threads)
    kinds = {"int4": ("int4", torch.float32), "int8": ("int8", torch.float32),
             "fp32": ("none", torch.float32), "bf16": ("none", torch.bfloat16)}  # fmt: skip
    print(f"\nGEMMs, {threads} threads, best of 15; FLOP/s summed over {GEMM_SHAPES}\n")
    print("| rows | " + " | ".join(f"{k} GFLOP/s" for k in kinds) + " | oneDNN bf16 (peak) |"
          " int4 / peak |")  # fmt: skip
    print("|---:|" + "---:|" * (len(kinds) + 2))
    layers = {}
    for kind, (method, dtype) in kinds.items():
        layers[kind] = [
            quantize_linears(nn.Sequential(nn.Linear(k, n, bias=False).to(dtype)), method,
                             deterministic=True)[0]
            for k, n in GEMM_SHAPES
        ]  # fmt: skip
    peak = [OneDNNLinear(nn.Linear(k, n, bias=False).bfloat16()) for k, n in GEMM_SHAPES]
    for m in (512, 2048):
        flops = sum(2 * m * k * n for k, n in GEMM_SHAPES)
        xs = [torch.randn(m, k) for k, _ in GEMM_SHAPES]
        rate = {}
        with torch.inference_mode():
            for kind, (_, dtype) in kinds.items():
                typed = [x.to(dtype) for x in xs]
                t = _best_s(functools.partial(_run_all, layers[kind], typed))
                rate[kind] = flops / t / 1e9
            xb = [x.bfloat16() for x in xs]
            rate["peak"] = flops / _best_s(functools.partial(_run_all, peak, xb)) / 1e9
        cells = " | ".join(f"{rate[k]:.0f}" for k in kinds)
        print(f"| {m} | {cells} | {rate['peak']:.0f} | {rate['int4'] / rate['peak']:.2f} |")
    big = torch.empty(1024 * 2**20, dtype=torch.uint8)  # past the caches
    out = torch.empty_like(big)
    bandwidth = 2 * big.numel() / _best_s(lambda: out.copy_(big), 5)  # read + write
    print(f"\nDecode at batch 1: the matmuls of one step beside the weight-streaming bound "
          f"(memory bandwidth of a 1 GiB copy: {bandwidth / 1e9:.1f} GB/s)\n")  # fmt: skip
    print("| weights | bytes a step (MB) | time (ms) | bound (ms) | bound / time |")
    print("|---|---:|---:|---:|---:|")
    num_layers = 30  # SmolLM2's: a step reads each layer's own weights once
    for kind, (method, dtype) in kinds.items():
        step = [
            quantize_linears(nn.Sequential(nn.Linear(k, n, bias=False).to(dtype)), method,
                             deterministic=True)[0]
            for _ in range(num_layers) for k, n in GEMM_SHAPES
        ]  # fmt: skip
        nbytes = sum(b.numel() * b.element_size() for f in step for b in f.buffers())
        xs = [torch.randn(1, k).to(dtype) for _ in range(num_layers) for k, _ in GEMM_SHAPES]
        with torch.inference_mode():
            t = _best_s(functools.partial(_run_all, step, xs), 10)
        bound = nbytes / bandwidth
        print(f"| {kind} | {nbytes / 1e6:.1f} | {1e3 * t:.2f} | {1e3 * bound:.2f} | "
              f"{bound / t:.2f} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quantization", default="auto", help="pd serve's default: auto")
    ap.add_argument("--compile-buckets", default="auto", help="pd serve's default: auto")
    ap.add_argument("--gemm", action="store_true", help="also the GEMM tables")
    ap.add_argument("--only-gemm", action="store_true", help="the GEMM tables alone")
    args = ap.parse_args()
    print(f"CPU: {_cpu_name()}, PD_CPU_ISA={envs.PD_CPU_ISA}", flush=True)
    if args.gemm or args.only_gemm:
        gemm_table(args.threads)
        if args.only_gemm:
            return
    torch.set_num_threads(args.threads)
    engines = {}
    for name, det in (("deterministic", True), ("--no-deterministic", False)):
        t0 = time.perf_counter()
        engines[name] = Engine(
            EngineConfig(
                model=args.model, quantization=args.quantization, deterministic=det,
                compile_buckets=args.compile_buckets, enable_prefix_cache=False,
                max_total_tokens=16384, max_prefill_tokens=2048,
            )
        )  # fmt: skip
        print(f"{name}: built in {time.perf_counter() - t0:.0f} s", flush=True)
    runner = engines["deterministic"].runner
    rows: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            for n in PREFILL_LENS:
                prefill_ms(engine, n)  # warm-up of this length
                rows.setdefault(f"prefill {n} tokens (ms)", {}).setdefault(name, []).append(
                    prefill_ms(engine, n)
                )
            for b in DECODE_BATCHES:
                rows.setdefault(f"decode batch {b} (tokens/s)", {}).setdefault(name, []).append(
                    decode_tokens_per_s(engine, b)
                )
    print(
        f"\n{_cpu_name()}, {args.threads} threads, {runner.model_dir.name}, weights "
        f"{runner.quantization}, compiled buckets {runner.cfg.buckets or 'off'}, "
        f"medians of {args.rounds} alternating rounds\n"
    )
    print("| | deterministic (default) | --no-deterministic | deterministic / no |")
    print("|---|---:|---:|---:|")
    for metric, by in rows.items():
        det, non = (
            statistics.median(by["deterministic"]),
            statistics.median(by["--no-deterministic"]),
        )
        print(f"| {metric} | {det:.1f} | {non:.1f} | {det / non:.2f}x |")


def _cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    return names[0] if names else "?"


if __name__ == "__main__":
    main()
