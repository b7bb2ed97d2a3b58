"""Serving benchmark for any OpenAI-compatible server (pd, vLLM, SGLang, llama.cpp, ...).

Streams /v1/completions (or /v1/chat/completions) and reports TTFT, TPOT, ITL and end-to-end
latency (p50/p90/p99), request and output-token throughput, goodput (requests/s meeting
--slo-ttft and --slo-tpot), and the prefix-cache hit rate two ways: from the responses'
``usage.prompt_tokens_details.cached_tokens``, and from the server's /metrics (pd counters,
before/after delta) when it exposes them.

Workloads:
  shared-prefix  --num-groups G × --prompts-per-group M prompts; each group shares a prefix of
                 --prefix-len words (or tokens with --tokenizer), then a unique suffix.
  fixed          one prompt (--prefix-len + --suffix-len) sent --num-prompts times.
  cached-prefix  one prefix of exactly --prefix-len token ids (random, from the model's vocab),
                 cached by one warm-up request, then --num-prompts sequential requests of
                 prefix + --suffix-len new random ids: TTFT with a fully cached prefix.
  chat           /v1/chat/completions: --num-groups system prompts of --prefix-len tokens (plus
                 a one-line preamble), --prompts-per-group different questions each.
  multiturn      /v1/chat/completions: --num-groups conversations of --prompts-per-group turns
                 over their own --prefix-len system prompt, each turn's history holding the
                 earlier questions with fixed --max-tokens answers; sent round by round, so a
                 conversation's next turn comes after every other conversation's.
  trace          replays a Mooncake-format JSONL (--trace; scripts/make_trace.py writes one) at
                 its timestamps × --time-scale, open loop: equal hash ids are equal 512-token
                 blocks of text, each request asks for its output_length tokens.
  copy           /v1/chat/completions: --num-prompts requests to repeat a 100-200 word text
                 (paragraphs of /usr/share/common-licenses/GPL-3, chosen by --seed) exactly, or
                 with one word upper-cased: answers copy the prompt, for benchmarking n-gram
                 (prompt-lookup) speculative decoding. Give room for the whole copy and let it
                 stop: --max-tokens 400 --no-ignore-eos.

    python scripts/bench_serving.py --url http://127.0.0.1:8000 --workload shared-prefix \\
        --num-groups 4 --prompts-per-group 8 --max-concurrency 8 --json out.json

With --launch "label=ARGS" (repeatable) it starts `pd serve ARGS` itself for each (a free
loopback port), runs the workload against it, stops it, and prints one table comparing them;
--launch-llamacpp "label[=ARGS]" does the same for llama-cpp-python's server (the CPU peer,
built by scripts/setup_llamacpp.sh) and --launch-vllm "label[=ARGS]" for `vllm serve ARGS`
(vLLM's CPU build at its defaults, built by scripts/setup_vllm.sh; it compiles its model on
every start, 2-3 minutes), one server at a time, in command-line order:

    python scripts/bench_serving.py --workload chat --num-groups 4 --prompts-per-group 3 \\
        --prefix-len 620 --max-tokens 32 --max-concurrency 4 --launch-llamacpp llamacpp \\
        --launch-vllm vllm --launch "1p1d=--prefill 1 --decode 1" --launch "colocated=--colocated"
    python scripts/bench_serving.py --workload trace --trace trace.jsonl --time-scale 1 \\
        --plot-dir plots/ --launch "1p1d=--prefill 1 --decode 1" ...
    python scripts/bench_serving.py --url http://127.0.0.1:8000 --workload copy \\
        --num-prompts 32 --max-tokens 400 --no-ignore-eos --max-concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

import httpx

from pdtools.bench_client import Result, one_request, scrape
from pdtools.bench_launch import SERVERS, check_launchable, launched, parse_launch
from pdtools.bench_report import (
    compare_markdown,
    goodput_markdown,
    markdown,
    summarize,
    write_plots,
)
from pdtools.bench_workloads import (
    Request,
    make_cached_prefix,
    make_chat,
    make_copy,
    make_multiturn,
    make_prompts,
    make_trace_requests,
)
from pdtools.trace import read_trace

__all__ = ["compare_markdown", "main"]
WORKLOADS = ("shared-prefix", "fixed", "cached-prefix", "chat", "multiturn", "trace", "copy")


def make_requests(args: argparse.Namespace) -> tuple[list[Request], list[Request]]:
    """(warm-up requests, measured requests) of args.workload."""
    if args.workload == "cached-prefix":
        first, prompts = make_cached_prefix(args)
        args.max_concurrency = 1  # sequential: TTFT of a lone request, nothing queued
        return [Request(prompt=first)], [Request(prompt=p) for p in prompts]
    if args.workload == "chat":
        return [], make_chat(args)
    if args.workload == "multiturn":
        return [], make_multiturn(args)
    if args.workload == "trace":
        return [], make_trace_requests(args, read_trace(args.trace))
    if args.workload == "copy":
        return [], make_copy(args)
    return [], [Request(prompt=p) for p in make_prompts(args)]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    warmup, requests = make_requests(args)
    limits = httpx.Limits(max_connections=args.max_concurrency or 1000)
    timeout = httpx.Timeout(args.timeout)
    async with httpx.AsyncClient(base_url=args.url, timeout=timeout, limits=limits) as client:
        if args.model is None:
            args.model = (await client.get("/v1/models")).json()["data"][0]["id"]
        for req in warmup:  # not measured; /metrics deltas start after it
            if not (res := await one_request(client, args, req)).ok:
                raise RuntimeError(f"warm-up request failed: {res.error}")
        before = await scrape(client)
        sem = asyncio.Semaphore(args.max_concurrency or len(requests) or 1)
        rng = random.Random(args.seed + 1)

        async def limited(req: Request) -> Result:
            async with sem:
                return await one_request(client, args, req)

        start = time.perf_counter()
        tasks = []
        for req in sorted(requests, key=lambda r: r.send_at_s or 0.0):
            if req.send_at_s is not None:  # a trace's arrival time, whatever came back
                await asyncio.sleep(max(0.0, start + req.send_at_s - time.perf_counter()))
            tasks.append(asyncio.create_task(limited(req)))
            if args.request_rate != float("inf"):  # Poisson arrivals
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = await scrape(client)
    return summarize(args, results, duration, before, after)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (no /v1)")
    p.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    p.add_argument("--workload", choices=WORKLOADS, default="shared-prefix")
    p.add_argument("--num-groups", type=int, default=4, help="shared-prefix and chat")
    p.add_argument("--prompts-per-group", type=int, default=8, help="questions, for chat")
    p.add_argument("--num-prompts", type=int, default=32, help="fixed, cached-prefix, copy")
    p.add_argument(
        "--prefix-len",
        type=int,
        default=256,
        help="words, or tokens with --tokenizer; chat: system prompt tokens",
    )
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer dir (default for chat, trace, cached-prefix: pd's default model's)",
    )
    p.add_argument("--trace", default=None, help="trace: a Mooncake-format JSONL file")
    p.add_argument("--time-scale", type=float, default=1.0, help="trace: timestamps × this")
    p.add_argument("--max-tokens", type=int, default=64, help="trace: each request's own")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s, Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="goodput's TTFT objective, s")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="goodput's TPOT objective, s")
    p.add_argument("--plot-dir", default=None, help="trace: write ttft_cdf.png, goodput.png here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="", help="name of this run in the table and JSON")
    p.add_argument("--json", default=None, help="also write the summary to this file ('-': stdout)")
    for kind, server in SERVERS.items():
        p.add_argument(
            "--launch" + ("" if kind == "pd" else f"-{kind}"),
            dest="launch",
            action="append",
            type=lambda spec, kind=kind: parse_launch(spec, kind),  # bad specs fail at once
            default=None,
            metavar="[LABEL=]ARGS",
            help=f"start {server} on a free port and benchmark it (repeatable; --url unused)",
        )
    args = p.parse_args(argv)
    if (args.workload == "trace") != (args.trace is not None):
        p.error("--trace goes with --workload trace, and it needs one")
    if args.time_scale <= 0 or args.slo_ttft <= 0 or args.slo_tpot <= 0:
        p.error("--time-scale, --slo-ttft and --slo-tpot must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.launch:
        return main_launch(args)
    args.url = args.url.rstrip("/").removesuffix("/v1")
    summary = asyncio.run(run(args))
    print(markdown(summary))
    _report_trace(args, [(args.label or args.url, summary)])
    _write_json(args.json, summary)
    return 1 if summary["num_failed"] == summary["num_requests"] else 0


def main_launch(args: argparse.Namespace) -> int:
    try:
        for launch in args.launch:
            check_launchable(launch)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows: list[tuple[str, dict[str, Any] | None]] = []
    for launch in args.launch:
        run_args = argparse.Namespace(**{**vars(args), "label": launch.label, "model": args.model})
        try:
            with launched(launch) as url:
                run_args.url = url
                summary = asyncio.run(run(run_args))
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            rows.append((launch.label, None))
            continue
        print(markdown(summary) + "\n", flush=True)
        rows.append((launch.label, summary))
    print(compare_markdown(rows))
    _report_trace(args, [(label, s) for label, s in rows if s is not None])
    _write_json(args.json, [s for _, s in rows])
    return 0 if all(s is not None and s["num_failed"] == 0 for _, s in rows) else 1


def _report_trace(args: argparse.Namespace, rows: list[tuple[str, dict[str, Any]]]) -> None:
    """The trace replay's goodput table, and its plots with --plot-dir."""
    if args.workload != "trace" or not rows:
        return
    print("\n" + goodput_markdown(rows))
    if args.plot_dir:
        for path in write_plots(rows, args.plot_dir):
            print(f"wrote {path}", file=sys.stderr)


def _write_json(path: str | None, data: Any) -> None:
    if path == "-":
        json.dump(data, sys.stdout, indent=2)
    elif path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
