"""What logprobs and penalties cost a decode step: the engine's decode step time at batch 1 and
32 with each sampling variant beside plain greedy decoding, on the same engine and prompts, the
variants interleaved in each round (best round of each kept); then the sampler alone
(``sample`` on a batch of random logits of the model's vocabulary, the requests' token counts
kept up to date as in a decode step), which the forward's noise does not hide.

    python scripts/bench_sampling.py [--model PATH] [--quantization auto] [--threads 2]
        [--steps 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import torch

# run as a script, scripts/ is on the path: the cpu name of the engine tables
from bench_attention import _cpu_name

from pd.core.request import Req
from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from pd.executor.penalties import TokenCounts
from pd.executor.sampler import make_generator, sample

PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2}
VARIANTS: dict[str, dict[str, object]] = {
    "greedy (baseline)": {"temperature": 0.0},
    "greedy + logprobs": {"temperature": 0.0, "logprobs": 0},
    "greedy + top_logprobs 5": {"temperature": 0.0, "logprobs": 5},
    "greedy + top_logprobs 20": {"temperature": 0.0, "logprobs": 20},
    "greedy + 3 penalties": {"temperature": 0.0, **PENALTIES},
    "sampled (t 0.8, top_p 0.9)": {"temperature": 0.8, "top_p": 0.9, "seed": 1},
    "sampled + min_p 0.05": {"temperature": 0.8, "top_p": 0.9, "seed": 1, "min_p": 0.05},
    "sampled + penalties + top_logprobs 20": {
        "temperature": 0.8,
        "top_p": 0.9,
        "seed": 1,
        "logprobs": 20,
        **PENALTIES,
    },
}


def decode_step_seconds(
    engine: Engine, batch: int, prompt_len: int, steps: int, params: SamplingParams
) -> float:
    """Mean seconds of one decode step of ``batch`` requests (prefill excluded)."""
    vocab = engine.runner.model_config.vocab_size
    g = torch.Generator().manual_seed(batch)
    for prompt in torch.randint(100, vocab, (batch, prompt_len), generator=g).tolist():
        engine.add_request(prompt, params)
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = time.perf_counter() - t0
    while engine.has_unfinished:
        engine.step()
    return dt / steps


def sampler_seconds(batch: int, vocab: int, params: SamplingParams, repeat: int) -> float:
    """Best seconds of one ``sample`` call (with the penalties' counts) on [batch, vocab]."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=g)
    reqs = [Req(f"r{i}", list(range(i, i + 64)), params) for i in range(batch)]
    for req in reqs:
        req.output_ids = list(range(1000, 1032))
        req.generator = make_generator(req.params, 0)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        counts = [TokenCounts.of(r, vocab) for r in reqs]
        sample(logits, [r.params for r in reqs], [r.generator for r in reqs], (), counts)
        best = min(best, time.perf_counter() - t0)
    return best


def _table(title: str, batches: list[int], best: dict[tuple[int, str], float]) -> None:
    print(f"\n{title}\n\n| variant | batch | ms | vs greedy |\n|---|---|---|---|")
    for batch in batches:
        base = best[(batch, "greedy (baseline)")]
        for name in VARIANTS:
            s = best[(batch, name)]
            print(f"| {name} | {batch} | {s * 1e3:.2f} | {s / base:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--quantization", default="auto", help="auto: int4 on a cpu (pd serve's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--batches", default="1,32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(
        EngineConfig(
            model=args.model,
            quantization=args.quantization,
            max_total_tokens=40 * (args.prompt_len + args.steps + 8),
            max_running_requests=64,
            enable_prefix_cache=False,  # every round computes its prompts alike
        )
    )
    batches = [int(b) for b in args.batches.split(",")]
    best: dict[tuple[int, str], float] = {}
    for r in range(args.rounds):
        for batch in batches:
            for name, kw in VARIANTS.items():
                params = SamplingParams(max_tokens=args.steps + 2, ignore_eos=True, **kw)  # type: ignore[arg-type]
                s = decode_step_seconds(engine, batch, args.prompt_len, args.steps, params)
                key = (batch, name)
                best[key] = min(best.get(key, s), s)
                print(f"round {r + 1}: batch {batch}, {name}: {s * 1e3:.1f} ms", flush=True)
    vocab = engine.runner.model_config.vocab_size
    alone: dict[tuple[int, str], float] = {}
    for batch in batches:
        for name, kw in VARIANTS.items():
            params = SamplingParams(max_tokens=100, **kw)  # type: ignore[arg-type]
            alone[(batch, name)] = sampler_seconds(batch, vocab, params, repeat=10)
    print(
        f"\n{_cpu_name()}, {args.threads} threads; {args.model or 'SmolLM2-135M-Instruct'}, "
        f"{engine.runner.quantization} weights, vocab {vocab}"
    )
    _table(
        f"Decode step after a {args.prompt_len}-token prompt, best of {args.rounds} rounds of "
        f"{args.steps} steps (ms a step)",
        batches,
        best,
    )
    _table("The sampler alone, best of 10 calls (ms a call)", batches, alone)


if __name__ == "__main__":
    main()
