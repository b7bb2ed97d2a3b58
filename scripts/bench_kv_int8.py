"""int8 KV (``--kv-cache-dtype int8``) beside the model's own KV dtype, side by side in one run
(``--parts``, all four by default):

- ``engine``, per weight format (``--formats``): bytes per token of KV and the default pool's
  slots, decode ms/token at batch 1, decode tokens/s at batch 16, prefill tokens/s at 512 tokens
  (best of ``--rounds``, engines taking turns), greedy agreement with the same weights' fp32 KV
  over bench_quant's chat prompts (tokens equal position by position, and prompts equal in full)
  and perplexity on its licence text (512-token windows: each token attends to the int8 KV of
  those before it).
- ``transfer``: the KV of a 2,048-token prompt of the default model moved between two
  processes' pools over gloo (scripts/bench_transfer.py's "both one run" case): its bytes, and
  "prefill done" -> "decode can start".
- ``pull``: scripts/bench_pull.py's pull run (``pd serve --prefill 2 --decode 1``, each
  conversation's second turn sent to the prefill node without its ~1,000-token prefix), once per
  KV dtype, compiled steps off in both (start-up time only): the pulls' time and the second
  turns' TTFT.
- ``tiers``, the tier check at equal memory: the colocated engine at the defaults' int4 weights,
  a pool of ``--tier-pool`` fp32 tokens' bytes and a host tier of the same bytes, in slots of
  each KV dtype; ``--tier-prefixes`` prefixes of ``--tier-prefix-tokens`` (4x the fp32 pool by
  default) asked once each in order, then ``--tier-requests`` times in a random order (each
  with 16 tokens of its own): the hit rate of those (cached prompt tokens) and their TTFT p50.

    python scripts/bench_kv_int8.py [--parts engine,transfer,pull,tiers] [--formats fp32,int4]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
from typing import Any

import torch
from bench_cache import time_to_first_token
from bench_quant import (
    FORMATS,
    PPL_TEXT,
    QUESTIONS,
    _agreement,
    greedy_tokens,
    measure_speed,
    perplexity,
)

from pd.engine.engine import Engine
from pd.executor.config import DEFAULT_KV_TOKENS, EngineConfig
from pd.model.tokenizer import encode_prompt

KV_DTYPES = ("auto", "int8")
PARTS = ("engine", "transfer", "pull", "tiers")


def make_engine(fmt: str, kv: str, model: str | None, **kw: Any) -> Engine:
    dtype, quantization, linear_backend = FORMATS[fmt]
    cfg = EngineConfig(
        model=model,
        dtype=dtype,
        quantization=quantization,
        linear_backend=linear_backend,
        kv_cache_dtype=kv,
        **{"max_total_tokens": 4096, **kw},
    )
    return Engine(cfg)


def engine_part(args: argparse.Namespace) -> None:
    if not PPL_TEXT.is_file():
        raise SystemExit(f"{PPL_TEXT} not found (Debian's base-files ships it); cannot run")
    text = PPL_TEXT.read_bytes()
    fmts = args.formats.split(",")
    engines = {(f, kv): make_engine(f, kv, args.model) for f in fmts for kv in KV_DTYPES}
    results: dict[tuple[str, str], dict[str, Any]] = {key: {} for key in engines}
    for _ in range(args.rounds):
        for key, engine in engines.items():
            for name, value in measure_speed(engine, args).items():
                better = min if name == "decode1_ms" else max
                results[key][name] = better(results[key].get(name, value), value)
    tokenizer = next(iter(engines.values())).tokenizer
    ids = encode_prompt(tokenizer, text.decode())[: args.ppl_tokens]
    for key, engine in engines.items():
        pool = engine.runner.pool
        results[key]["bytes"] = pool.num_bytes_per_token
        results[key]["slots"] = EngineConfig(
            kv_cache_dtype=key[1], dtype=FORMATS[key[0]][0]
        ).pool_slots(pool.head_dim)
        results[key]["greedy"] = greedy_tokens(engine, args.greedy_tokens)
        results[key]["ppl"] = perplexity(engine, ids, 512)
    print(
        f"\n## engine: threads={args.threads} perplexity text={PPL_TEXT} "
        f"sha256={hashlib.sha256(text).hexdigest()} ({args.ppl_tokens} tokens, 512-token "
        f"windows); greedy: {len(QUESTIONS)} chat prompts x {args.greedy_tokens} tokens\n"
    )
    print(
        "| weights | KV | bytes/token | default pool slots | decode b1 ms/token | decode b16 "
        "tok/s | prefill 512 tok/s | greedy = model-dtype KV tokens | prompts = | perplexity |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (fmt, kv), r in results.items():
        base = results[(fmt, "auto")]
        print(
            f"| {fmt} | {kv} | {r['bytes']:,} | {r['slots']:,} | {r['decode1_ms']:.1f} "
            f"| {r['decode16']:,.0f} | {r['prefill512']:,.0f} "
            f"| {_agreement(r['greedy'], base['greedy'])} | {r['ppl']:.3f} |"
        )


def transfer_part(args: argparse.Namespace) -> None:
    from bench_transfer import bench_transfer

    print("\n## transfer: a 2,048-token prompt's KV, gloo on loopback, both slots one run\n")
    print("| KV | MB | data (ms) | prefill done -> decode can start (ms) | MB/s |")
    print("|---|---:|---:|---:|---:|")
    for kv in KV_DTYPES:
        ns = argparse.Namespace(
            tokens=2048, iters=args.iters, backend="gloo", layers=30, heads=3, head_dim=64,
            poll_ms=1.0, kv_cache_dtype=kv,
        )  # fmt: skip
        r = bench_transfer(ns, False, False)
        mb = r["nbytes"] / 1e6
        print(
            f"| {kv} | {mb:.1f} | {1e3 * r['data']:.1f} | {1e3 * r['ready']:.1f} "
            f"| {mb / r['data']:,.0f} |"
        )


def pull_part(args: argparse.Namespace) -> None:
    from bench_pull import _run

    ns = argparse.Namespace(conversations=args.conversations, prefix_tokens=1000, seed=0)
    print(f"\n## pull: {args.conversations} second turns over ~1,000-token prefixes\n")
    print("| KV | pulls | pull p50 (ms) | pull runs (ms) | second turn TTFT p50 (ms) |")
    print("|---|---:|---:|---|---:|")
    for kv in KV_DTYPES:
        run = _run(f"pull-{kv}", ["--compile-buckets", "off", "--kv-cache-dtype", kv], ns)
        decisions = run["pulls"].get("decisions", [])
        pulled = [
            d["pull_s"]
            for d in decisions
            if d["num_tokens"] >= 500 and d["choice"] == "pull" and not d["error"] and d["pull_s"]
        ]
        p50 = f"{1e3 * statistics.median(pulled):.0f}" if pulled else "-"
        print(
            f"| {kv} | {len(pulled)} | {p50} | {', '.join(f'{1e3 * s:.0f}' for s in pulled)} "
            f"| {1e3 * statistics.median(run['ttft']):.0f} |"
        )


def tiers_part(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    prefixes = [
        [rng.randrange(1000, 40000) for _ in range(args.tier_prefix_tokens)]
        for _ in range(args.tier_prefixes)
    ]
    order = list(range(args.tier_prefixes))
    order += [rng.randrange(args.tier_prefixes) for _ in range(args.tier_requests)]
    prompts = [prefixes[i] + [rng.randrange(1000, 40000) for _ in range(16)] for i in order]
    print(
        f"\n## tiers: int4 weights; a pool of {args.tier_pool:,} fp32 tokens' bytes and a host "
        f"tier of the same bytes; {args.tier_prefixes} prefixes x {args.tier_prefix_tokens} "
        f"tokens ({args.tier_prefixes * args.tier_prefix_tokens / args.tier_pool:.1f}x the fp32 "
        f"pool), asked once each, then {args.tier_requests} times at random (those measured)\n"
    )
    print("| KV | pool + host slots | hit rate | TTFT p50 (ms) | TTFT p90 (ms) |")
    print("|---|---:|---:|---:|---:|")
    for kv in KV_DTYPES:
        # the same bytes, in slots of ``kv`` (the config's own rule for the default pool)
        slots = EngineConfig(kv_cache_dtype=kv).pool_slots(64) * args.tier_pool // DEFAULT_KV_TOKENS
        engine = make_engine(
            "int4", kv, args.model, max_total_tokens=slots, host_cache_tokens=slots
        )
        assert engine.runner.pool.head_dim == 64, "the slots above assume head_dim 64"
        cached = total = 0
        ttft = []
        for i, prompt in enumerate(prompts):
            seconds, _, num_cached = time_to_first_token(engine, prompt)
            if i >= args.tier_prefixes:
                ttft.append(1e3 * seconds)
                cached, total = cached + num_cached, total + len(prompt)
        q = statistics.quantiles(ttft, n=10)
        print(
            f"| {kv} | {2 * slots:,} | {100 * cached / total:.1f}% | "
            f"{statistics.median(ttft):.0f} | {q[-1]:.0f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--model", default=None)
    ap.add_argument("--formats", default="fp32,int4", help=f"weight formats of {list(FORMATS)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--greedy-tokens", type=int, default=64)
    ap.add_argument("--ppl-tokens", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=5, help="transfers per KV dtype")
    ap.add_argument("--conversations", type=int, default=4, help="second turns per pull run")
    ap.add_argument("--tier-pool", type=int, default=1024)
    ap.add_argument("--tier-prefixes", type=int, default=16)
    ap.add_argument("--tier-prefix-tokens", type=int, default=256)
    ap.add_argument("--tier-requests", type=int, default=48)
    args = ap.parse_args()
    parts = args.parts.split(",")
    if unknown := [p for p in parts if p not in PARTS]:
        ap.error(f"unknown parts {unknown}; known: {', '.join(PARTS)}")
    if unknown := [f for f in args.formats.split(",") if f not in FORMATS]:
        ap.error(f"unknown formats {unknown}; known: {', '.join(FORMATS)}")
    torch.set_num_threads(args.threads)
    for part in parts:
        globals()[f"{part}_part"](args)


if __name__ == "__main__":
    main()
