"""int8 KV (``--kv-cache-dtype int8``) beside the model's own KV dtype, in the same run, per
weight format: bytes per token of KV and the default pool's slots, decode ms/token at batch 1,
decode tokens/s at batch 16, prefill tokens/s at 512 tokens (best of ``--rounds``, engines
taking turns), greedy agreement with the same weights' fp32 KV over bench_quant's chat prompts
(tokens equal position by position, and prompts equal in full) and perplexity on its licence
text (512-token windows: each token attends to the int8 KV of those before it).

    python scripts/bench_kv_int8.py [--formats fp32,int4] [--threads 2]
"""

from __future__ import annotations

import argparse
import hashlib
from typing import Any

import torch
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
from pd.executor.config import EngineConfig
from pd.model.tokenizer import encode_prompt


def make_engine(fmt: str, kv: str, model: str | None) -> Engine:
    dtype, quantization, linear_backend = FORMATS[fmt]
    cfg = EngineConfig(
        model=model,
        dtype=dtype,
        quantization=quantization,
        linear_backend=linear_backend,
        kv_cache_dtype=kv,
        max_total_tokens=4096,
    )
    return Engine(cfg)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--formats", default="fp32,int4", help=f"weight formats of {list(FORMATS)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--greedy-tokens", type=int, default=64)
    ap.add_argument("--ppl-tokens", type=int, default=2048)
    args = ap.parse_args()
    fmts = args.formats.split(",")
    if unknown := [f for f in fmts if f not in FORMATS]:
        ap.error(f"unknown formats {unknown}; known: {', '.join(FORMATS)}")
    if not PPL_TEXT.is_file():
        raise SystemExit(f"{PPL_TEXT} not found (Debian's base-files ships it); cannot run")
    text = PPL_TEXT.read_bytes()
    torch.set_num_threads(args.threads)
    engines = {(f, kv): make_engine(f, kv, args.model) for f in fmts for kv in ("auto", "int8")}
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
        f"threads={args.threads} perplexity text={PPL_TEXT} "
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


if __name__ == "__main__":
    main()
