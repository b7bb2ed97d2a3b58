"""The shared-prefix chat load of ``bench_serving.py --workload chat``, replayed on the colocated
``Engine`` in this process: where a server's time goes when HTTP, detokenizing and the client
are taken away.

The same requests (``bench_workloads.make_chat``: --num-groups system prompts of --prefix-len
tokens, --prompts-per-group questions each, shuffled), greedy, --max-tokens each with EOS
ignored, --max-concurrency in flight (a new one added as one finishes, closed loop). Each
engine step is timed and counted by kind:

- ``prefill``: a step that computes 256 or more prompt tokens (a cold system prompt);
- ``mixed``: fewer prompt tokens (a follow-up's question, or a chunk's rest), with or
  without decode rows beside them; eager;
- ``decode``: one-token rows only, eager; ``compiled``: the same in a compiled bucket.

Each config (``label=ENGINE ARGS``, the flags ``pd serve`` takes for its engine, with its
defaults: int4 and compiled steps for batches of 1, 2 and 4 on a CPU) runs in turn,
in a fresh process; the first is the baseline of the ratio column. Compare the req/s here with
``bench_serving.py``'s for the same flags: the difference is what serving costs on the same
cores.

    python scripts/bench_chat_engine.py --num-groups 4 --prompts-per-group 3 --prefix-len 620 \\
        --max-tokens 32 --max-concurrency 4 \\
        --config "bf16-compiled=--dtype bfloat16 --compile-buckets 1,2,4" \\
        --config "int4-compiled=--quantization int4 --compile-buckets 1,2,4"
"""

from __future__ import annotations

import argparse
import collections
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

KINDS = ("prefill", "mixed", "decode", "compiled")
PREFILL_MIN_TOKENS = 256


def _parse_config(spec: str) -> tuple[str, str]:
    label, sep, flags = spec.partition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"want LABEL=ENGINE ARGS, got {spec!r}")
    return label, flags


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-groups", type=int, default=4)
    p.add_argument("--prompts-per-group", type=int, default=3)
    p.add_argument("--prefix-len", type=int, default=620)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--config", dest="configs", action="append", type=_parse_config, default=None,
        metavar="LABEL=ENGINE ARGS", help="an engine to run (repeatable; the first: baseline)",
    )  # fmt: skip
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: run this config
    return p.parse_args(argv)


def run_one(args: argparse.Namespace, flags: str) -> dict[str, object]:
    """Build the engine from ``flags`` and replay the load; -> the summary."""
    from pd.cli import build_parser, engine_config
    from pd.core.sampling_params import SamplingParams
    from pd.engine.engine import Engine
    from pd.model.tokenizer import encode_chat
    from pdtools.bench_workloads import make_chat

    t0 = time.perf_counter()
    engine = Engine(engine_config(build_parser().parse_args(["serve", *shlex.split(flags)])))
    start_s = time.perf_counter() - t0
    load = argparse.Namespace(
        tokenizer=None,
        num_groups=args.num_groups,
        prompts_per_group=args.prompts_per_group,
        prefix_len=args.prefix_len,
        seed=args.seed,
    )
    prompts = [encode_chat(engine.tokenizer, r.messages) for r in make_chat(load)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    # warm-up on an unrelated prompt: the first forward's one-time costs stay out
    hello = encode_chat(engine.tokenizer, [{"role": "user", "content": "Hello"}])
    engine.generate([hello], SamplingParams(max_tokens=4, temperature=0.0))

    runner = engine.runner
    steps: list[tuple[str, float]] = []
    run = runner.run

    def timed_run(reqs, seqs, *rest, **kw):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        out = run(reqs, seqs, *rest, **kw)
        seconds = time.perf_counter() - t
        prompt_tokens = sum(len(s.new_token_ids) for s in seqs if len(s.new_token_ids) > 1)
        if prompt_tokens >= PREFILL_MIN_TOKENS:
            kind = "prefill"
        elif prompt_tokens or any(s.num_prefix == 0 for s in seqs):
            kind = "mixed"
        else:
            kind = "compiled" if runner.graphs.bucket_for(seqs) is not None else "decode"
        steps.append((kind, seconds))
        return out

    runner.run = timed_run  # type: ignore[method-assign]
    waiting = collections.deque(prompts)
    live: set[str] = set()
    t0 = time.perf_counter()
    while waiting or live:
        while waiting and len(live) < args.max_concurrency:
            live.add(engine.add_request(waiting.popleft(), params))
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            if out.finished:
                live.discard(out.request_id)
    wall = time.perf_counter() - t0
    runner.run = run  # type: ignore[method-assign]
    by_kind = {k: [s for kind, s in steps if kind == k] for k in KINDS}
    return {
        "start_s": start_s,
        "wall_s": wall,
        "req_s": len(prompts) / wall,
        "hit_rate": engine.num_cached_tokens / max(engine.num_prompt_tokens, 1),
        "steps": {k: (len(v), sum(v)) for k, v in by_kind.items()},
    }


def markdown(results: list[tuple[str, dict]]) -> str:
    """One row per config; per kind of step, its total ms and (in brackets) how many ran."""
    base = results[0][1]["req_s"]
    head = "| config | start s | run s | req/s | vs first | hit rate |"
    rule = "|---|---:|---:|---:|---:|---:|"
    for k in KINDS:
        head += f" {k} ms (steps) | {k} ms/step |"
        rule += "---:|---:|"
    lines = [head, rule]
    for label, r in results:
        line = (
            f"| {label} | {r['start_s']:.0f} | {r['wall_s']:.2f} | {r['req_s']:.2f} | "
            f"{r['req_s'] / base:.2f}x | {r['hit_rate']:.1%} |"
        )
        for k in KINDS:
            n, s = r["steps"][k]
            line += f" {s * 1e3:.0f} ({n}) | {s / n * 1e3 if n else 0:.1f} |"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one is not None:
        print(json.dumps(run_one(args, args.one)))
        return 0
    configs = args.configs or [("defaults", "")]
    results = []
    here = list(argv if argv is not None else sys.argv[1:])
    for label, flags in configs:  # one process each: compiled graphs and threads start fresh
        child = [sys.executable, str(Path(__file__).resolve()), *here, f"--one={flags}"]
        done = subprocess.run(child, capture_output=True, text=True, check=False)
        if done.returncode:
            print(f"[{label}] failed:\n{done.stderr[-2000:]}", file=sys.stderr)
            return 1
        results.append((label, json.loads(done.stdout.strip().splitlines()[-1])))
        print(f"[{label}] {results[-1][1]['req_s']:.2f} req/s", file=sys.stderr, flush=True)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
