"""The cost of deterministic inference: the engine at ``pd serve``'s defaults (int4 weights and
compiled decode steps on a CPU), deterministic (the default) beside ``--no-deterministic`` (the
numerics before it: long prefill chunks by a bf16 copy of the weights and SDPA), in one process,
measured in alternating rounds (medians).

Prefill: one cold prompt of N tokens in one forward (a request's time to first token, unloaded).
Decode: B requests of 128-token prompts stepping together (tokens/s; batches of 1, 2 and 4 run
in compiled steps, larger ones eagerly).

    python scripts/bench_deterministic.py [--rounds 3] [--threads 2] [--quantization auto]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pd.core.batch import SeqInput
from pd.core.sampling_params import SamplingParams
from pd.engine.config import EngineConfig
from pd.engine.engine import Engine

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


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quantization", default="auto", help="pd serve's default: auto")
    ap.add_argument("--compile-buckets", default="auto", help="pd serve's default: auto")
    args = ap.parse_args()
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
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in open("/proc/cpuinfo")
            if ln.startswith("model name")
        ),
        "?",
    )
    print(
        f"\n{cpu}, {args.threads} threads, {runner.model_dir.name}, weights "
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


if __name__ == "__main__":
    main()
