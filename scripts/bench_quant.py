"""CPU weight formats beside fp32, in the same run: speed, greedy agreement and perplexity.

Per format: decode ms/token at batch 1, decode tokens/s at batch 16, prefill tokens/s at 512
tokens (best of ``--rounds``, formats taking turns); greedy agreement with fp32 over chat
prompts (identical tokens position by position, and prompts identical in full); perplexity on
a fixed licence text that ships with Debian. ``fp32`` and ``bf16`` run oneDNN's packed matmuls
(the default where they run); ``-aten`` rows run torch's default GEMM on the same weights;
``int4-torch`` runs torch's int4 op where ``int4`` may run pd's (``pd.model.int4_kernel``).
With ``--llamacpp`` the CPU peer joins as a row: llama.cpp (llama-cpp-python, built by
``scripts/setup_llamacpp.sh``) on the Q4_1 GGUF that pd's fp32 weights are dequantized from,
given the same token ids (``scripts/llamacpp_quality.py``, run by the side venv); its batch-16
column is empty (one sequence at a time).

    python scripts/bench_quant.py [--formats fp32,fp32-aten,bf16,int8,int4,fp16] [--threads 2]
        [--llamacpp]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from bench_engine import pd_decode, pd_prefill

from pd.core.batch import SeqInput
from pd.core.kv_pool import SlotAllocator
from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from pd.model.loader import default_gguf_path
from pd.model.tokenizer import encode_chat, encode_prompt
from pdtools.bench_launch import LLAMACPP_PYTHON

FORMATS = {  # name -> dtype, quantization, linear_backend
    "fp32": ("float32", "none", "auto"),
    "fp32-aten": ("float32", "none", "aten"),
    "bf16": ("bfloat16", "none", "auto"),
    "bf16-aten": ("bfloat16", "none", "aten"),
    "int8": ("float32", "int8", "auto"),
    "int4": ("float32", "int4", "auto"),
    "int4-torch": ("float32", "int4", "auto"),  # torch's int4 op for few rows (PD_INT4_KERNEL)
    "fp16": ("float32", "fp16", "auto"),
}
PPL_TEXT = Path("/usr/share/common-licenses/GPL-3")
QUESTIONS = (
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Give me three tips for better sleep.",
    "Who wrote Pride and Prejudice?",
    "What is the difference between a virus and a bacterium?",
    "Translate 'good morning' into Spanish and German.",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "List the planets of the solar system in order.",
    "What is 17 times 23? Show your steps.",
    "Describe how a bicycle works.",
    "What are prime numbers? Give examples.",
    "Suggest a name for a bakery and explain it.",
)


def chat_prompts(tokenizer: Any) -> list[list[int]]:
    return [encode_chat(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]


def greedy_tokens(engine: Engine, num_tokens: int) -> list[list[int]]:
    prompts = chat_prompts(engine.tokenizer)
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    return [r.token_ids for r in engine.generate(prompts, params)]


def perplexity(engine: Engine, ids: list[int], window: int) -> float:
    """exp(mean next-token NLL) over non-overlapping ``window``-token chunks of ``ids``."""
    runner = engine.runner
    alloc = SlotAllocator(runner.pool.num_slots, 1)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - window + 1, window):
        chunk = ids[start : start + window]
        slots = alloc.allocate(window)
        logits = runner.forward([SeqInput(chunk, slots, 0)], return_all_logits=True)
        alloc.free(slots)
        nll += F.cross_entropy(logits[:-1], torch.tensor(chunk[1:]), reduction="sum").item()
        count += window - 1
    return math.exp(nll / count)


def make_engine(name: str, model: str | None) -> Engine:
    dtype, quantization, linear_backend = FORMATS[name]
    cfg = EngineConfig(
        model=model,
        dtype=dtype,
        quantization=quantization,
        linear_backend=linear_backend,
        max_total_tokens=4096,
    )
    kernel = "torch" if name == "int4-torch" else os.environ.get("PD_INT4_KERNEL", "auto")
    with mock.patch.dict(os.environ, {"PD_INT4_KERNEL": kernel}):
        return Engine(cfg)


def measure_speed(engine: Engine, args: argparse.Namespace) -> dict[str, float]:
    return {
        "decode1_ms": 1000 / pd_decode(engine, 1, 128, args.decode_steps),
        "decode16": pd_decode(engine, 16, 128, args.decode_steps),
        "prefill512": pd_prefill(engine, 512, args.repeat),
    }


def llamacpp_results(
    tokenizer: Any, ppl_ids: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    """The peer's row: the same measures, by llama.cpp in its own venv and process."""
    if not LLAMACPP_PYTHON.is_file():
        raise SystemExit(f"--llamacpp: no {LLAMACPP_PYTHON}; run scripts/setup_llamacpp.sh")
    job = {
        "model": str(default_gguf_path()),
        "threads": args.threads,
        "prompts": chat_prompts(tokenizer),
        "num_tokens": args.greedy_tokens,
        "ppl_ids": ppl_ids,
        "window": 512,
        "decode_prompt_len": 128,
        "decode_steps": args.decode_steps,
        "prefill_len": 512,
        "rounds": args.rounds,
    }
    script = Path(__file__).with_name("llamacpp_quality.py")
    out = subprocess.run(
        [str(LLAMACPP_PYTHON), str(script)],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    return json.loads(out.stdout)


def _agreement(ours: list[list[int]], ref: list[list[int]]) -> str:
    same = sum(a == b for x, y in zip(ours, ref) for a, b in zip(x, y))
    total = sum(len(y) for y in ref)
    full = sum(x == y for x, y in zip(ours, ref))
    return f"{same / total:.1%} | {full}/{len(ref)}"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--greedy-tokens", type=int, default=64)
    ap.add_argument("--ppl-tokens", type=int, default=2048)
    ap.add_argument("--llamacpp", action="store_true", help="add llama.cpp's Q4_1 as a row")
    args = ap.parse_args()
    names = args.formats.split(",")
    if unknown := [n for n in names if n not in FORMATS]:
        ap.error(f"unknown formats {unknown}; known: {', '.join(FORMATS)}")
    if names[0] != "fp32":
        names.insert(0, "fp32")  # the baseline of every ratio
    if not PPL_TEXT.is_file():
        raise SystemExit(f"{PPL_TEXT} not found (Debian's base-files ships it); cannot run")
    text_bytes = PPL_TEXT.read_bytes()
    torch.set_num_threads(args.threads)

    engines = {name: make_engine(name, args.model) for name in names}
    # Formats take turns, round after round, and keep their best: load from other processes
    # then slows every format alike instead of whichever ran while it peaked.
    results: dict[str, dict[str, Any]] = {name: {} for name in names}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            for key, value in measure_speed(engine, args).items():
                better = min if key == "decode1_ms" else max
                results[name][key] = better(results[name].get(key, value), value)
    tokenizer = engines["fp32"].tokenizer  # one model, one tokenizer for every format
    ids = encode_prompt(tokenizer, text_bytes.decode())[: args.ppl_tokens]
    for name, engine in engines.items():
        results[name]["greedy"] = greedy_tokens(engine, args.greedy_tokens)
        results[name]["ppl"] = perplexity(engine, ids, 512)
    if args.llamacpp:
        del engines  # the peer gets the memory and the cores to itself
        results["llama.cpp Q4_1"] = llamacpp_results(tokenizer, ids, args)
    base = results["fp32"]
    print(
        f"threads={args.threads} perplexity text={PPL_TEXT} "
        f"sha256={hashlib.sha256(text_bytes).hexdigest()} ({args.ppl_tokens} tokens, "
        f"512-token windows); greedy: {len(QUESTIONS)} chat prompts x {args.greedy_tokens} "
        "tokens\n"
    )
    print(
        "| format | decode b1 ms/token | b1 vs fp32 | decode b16 tok/s | b16 vs fp32 "
        "| prefill 512 tok/s | prefill vs fp32 | greedy = fp32 tokens | prompts = fp32 "
        "| perplexity |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        b16 = (
            f"{r['decode16']:,.0f} | {r['decode16'] / base['decode16']:.2f}x"
            if "decode16" in r
            else "- | -"
        )
        print(
            f"| {name} | {r['decode1_ms']:.1f} | {base['decode1_ms'] / r['decode1_ms']:.2f}x "
            f"| {b16} | {r['prefill512']:,.0f} | {r['prefill512'] / base['prefill512']:.2f}x "
            f"| {_agreement(r['greedy'], base['greedy'])} | {r['ppl']:.3f} |"
        )


if __name__ == "__main__":
    main()
