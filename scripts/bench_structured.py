"""What a grammar's token mask costs a decode step: the engine's decode step time at batch 1 and
32 under a JSON schema, a regex and a JSON object beside plain decoding, on the same engine and
prompts, the variants interleaved in each round (best round of each kept); and the mask's own
work timed apart (each row's matcher brought up to date and its bitmask filled, then applied to
the batch's logits: what the runner adds to a step), best of ``--repeats``, which a loaded
machine's noise hides less. The schema is an unbounded array of objects, so the grammar is
still open at every measured step.

    python scripts/bench_structured.py [--model PATH] [--quantization auto] [--threads 2]
        [--steps 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import llguidance
import torch

# run as a script, scripts/ is on the path
from bench_attention import _cpu_name
from bench_sampling import decode_step_seconds

from pd.core.request import Req
from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.batch_sampler import grammar_masks
from pd.executor.config import EngineConfig
from pd.executor.grammar import Guide, apply_masks_

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "role", "tags"],
}
LLM = llguidance.LLMatcher
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
VARIANTS: dict[str, dict[str, object]] = {
    "greedy (baseline)": {"temperature": 0.0},
    "greedy + JSON schema": {
        "temperature": 0.0,
        "grammar": LLM.grammar_from_json_schema(
            {"type": "array", "items": PERSON}, defaults=JSON_LAYOUT
        ),
    },
    "greedy + regex": {"temperature": 0.0, "grammar": LLM.grammar_from_regex(r"([a-z ]+\.)+")},
    "sampled (t 0.8)": {"temperature": 0.8, "seed": 1},
    "sampled + JSON object": {
        "temperature": 0.8,
        "seed": 1,
        "grammar": LLM.grammar_from_json_schema(
            {"type": "array", "items": {"type": "object"}}, defaults=JSON_LAYOUT
        ),
    },
}


def mask_seconds(engine: Engine, batch: int, grammar: str, repeats: int) -> float:
    """Best seconds of one step's mask work for ``batch`` guided rows, each 24 tokens into an
    answer (the runner's ``_masks`` and the sampler's ``apply_masks_``)."""
    runner = engine.runner
    vocab = runner.model_config.vocab_size
    tok = engine.tokenizer
    answer = tok.encode(
        '[{"name": "Ann", "age": 31, "role": "admin", "tags": ["a", "b"]}, ',
        add_special_tokens=False,
    )
    reqs = [Req(f"b{i}", [1, 2, 3], SamplingParams(grammar=grammar)) for i in range(batch)]
    logits = torch.randn(batch, vocab)
    best = float("inf")
    for _ in range(repeats):
        for r in reqs:  # a fresh guide, fed the answer so far: what a new step syncs is 1 token
            r.guide, r.output_ids = None, answer[:-1]
            Guide.of(r, lambda: runner.grammar_tokenizer)
            r.output_ids = answer
        t0 = time.perf_counter()
        guides = [Guide.of(r, lambda: runner.grammar_tokenizer) for r in reqs]
        masks = grammar_masks(guides, vocab)
        apply_masks_(logits, torch.stack(masks))  # type: ignore[arg-type]
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--quantization", default="auto", help="auto: int4 on a cpu (pd serve's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--repeats", type=int, default=50)
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
    _ = engine.runner.grammar_tokenizer  # built once (seconds), before any round
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
    print(
        f"\n{_cpu_name()}, {args.threads} threads; {args.model or 'SmolLM2-135M-Instruct'}, "
        f"{engine.runner.quantization} weights, vocab {engine.runner.model_config.vocab_size}; "
        f"{llguidance.get_version()}; "
        f"decode step after a {args.prompt_len}-token prompt, best of {args.rounds} rounds of "
        f"{args.steps} steps\n"
    )
    json_grammar = str(VARIANTS["greedy + JSON schema"]["grammar"])
    print(
        "| the mask alone (JSON schema) | batch | ms / step | vs greedy's step |\n|---|---|---|---|"
    )
    for batch in batches:
        s = mask_seconds(engine, batch, json_grammar, args.repeats)
        base = best[(batch, "greedy (baseline)")]
        print(
            f"| matchers synced, masks filled and applied | {batch} | {s * 1e3:.2f} | {s / base:.3f}x |"
        )
    print("\n| variant | batch | ms / step | vs its plain decoding |\n|---|---|---|---|")
    for batch in batches:
        for name in VARIANTS:
            base_name = "sampled (t 0.8)" if name.startswith("sampled") else "greedy (baseline)"
            s, base = best[(batch, name)], best[(batch, base_name)]
            print(f"| {name} | {batch} | {s * 1e3:.1f} | {s / base:.2f}x |")


if __name__ == "__main__":
    main()
