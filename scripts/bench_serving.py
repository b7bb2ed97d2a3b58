"""Serving benchmark for any OpenAI-compatible server (pd, vLLM, SGLang, ...).

Streams /v1/completions and reports TTFT, TPOT, ITL and end-to-end latency (p50/p90/p99),
request and output-token throughput, and the prefix-cache hit rate two ways: from the
responses' ``usage.prompt_tokens_details.cached_tokens``, and from the server's /metrics
(pd counters, before/after delta) when it exposes them.

Workloads:
  shared-prefix  --num-groups G × --prompts-per-group M prompts; each group shares a prefix of
                 --prefix-len words (or tokens with --tokenizer), then a unique suffix.
  fixed          one prompt (--prefix-len + --suffix-len) sent --num-prompts times.
  cached-prefix  one prefix of exactly --prefix-len token ids (random, from the model's vocab),
                 cached by one warm-up request, then --num-prompts sequential requests of
                 prefix + --suffix-len new random ids: TTFT with a fully cached prefix.

    python scripts/bench_serving.py --url http://127.0.0.1:8000 --workload shared-prefix \\
        --num-groups 4 --prompts-per-group 8 --max-concurrency 8 --json out.json

With --launch "label=ARGS" (repeatable) it starts `pd serve ARGS` itself for each (a free
loopback port), runs the workload against it, stops it, and prints one table comparing them:

    python scripts/bench_serving.py --workload cached-prefix --prefix-len 2048 --max-tokens 2 \\
        --launch "cluster=--prefill 1 --decode 1" --launch "engine=--colocated"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from bench_launch import launched, parse_launch  # scripts/ is on sys.path when run as a script

_WORDS = (
    "the of and to in is for on that with as by at from this be are it an or was which have "
    "data model cache token prefix server request stream latency memory layer batch decode "
    "prefill node cluster router shared value system network time first second result paper "
    "method large small fast slow question answer example number table figure section"
).split()
_PD_PROMPT = "pd_prompt_tokens_total"
_PD_CACHED = "pd_cached_prompt_tokens_total"


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


Prompt = str | list[int]  # text, or token ids (/v1/completions takes both)


def make_cached_prefix(args: argparse.Namespace) -> tuple[list[int], list[list[int]]]:
    """(warm-up prompt, prompts): every prompt is the same --prefix-len ids + fresh ones."""
    rng = random.Random(args.seed)
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    else:  # pd's default model, whatever the server runs (ids must be valid for it)
        from pd.model.tokenizer import load_tokenizer

        tok = load_tokenizer(None)
    vocab = len(tok)
    assert vocab > 1000, vocab  # ids below 1000 hold the special tokens; skip them

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, vocab) for _ in range(n)]

    prefix = ids(args.prefix_len)
    warmup = prefix + ids(args.suffix_len)
    return warmup, [prefix + ids(args.suffix_len) for _ in range(args.num_prompts)]


def make_prompts(args: argparse.Namespace) -> list[str]:
    rng = random.Random(args.seed)
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
        vocab = len(tok)

        def text(n: int) -> str:  # random ids decode to n-ish tokens of noise
            return tok.decode([rng.randrange(1000, vocab) for _ in range(n)])
    else:

        def text(n: int) -> str:
            return " ".join(rng.choice(_WORDS) for _ in range(n))

    if args.workload == "fixed":
        return [text(args.prefix_len + args.suffix_len)] * args.num_prompts
    prompts = []
    for g in range(args.num_groups):
        prefix = f"[group {g}] " + text(args.prefix_len)
        prompts += [prefix + " " + text(args.suffix_len) for _ in range(args.prompts_per_group)]
    rng.shuffle(prompts)  # interleave groups so routing and eviction matter
    return prompts


async def one_request(
    client: httpx.AsyncClient, args: argparse.Namespace, prompt: Prompt
) -> Result:
    body: dict[str, Any] = {
        "model": args.model,
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True  # vLLM/SGLang/pd extension: every request runs max_tokens
    res = Result(ok=False)
    start = last = time.perf_counter()
    num_chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    res.error = str(event["error"].get("message"))
                    return res
                if event.get("usage"):
                    usage = event["usage"]
                    res.prompt_tokens = usage["prompt_tokens"]
                    res.output_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens") or 0
                choice = event["choices"][0] if event.get("choices") else {}
                # a first token may decode to no text yet (a partial UTF-8 byte): the finish
                # chunk then marks the first output, else TTFT would be undefined
                if choice.get("text") or (num_chunks == 0 and choice.get("finish_reason")):
                    now = time.perf_counter()
                    if num_chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    last = now
                    num_chunks += 1
    except httpx.HTTPError as e:
        res.error = repr(e)
        return res
    res.e2e = time.perf_counter() - start
    res.output_tokens = res.output_tokens or num_chunks  # servers without usage in streams
    res.ok = num_chunks > 0
    res.error = "" if res.ok else "no output"
    return res


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """Sum of each sample name in /metrics (labels dropped); {} when there is none."""
    try:
        r = await client.get("/metrics")
    except httpx.HTTPError:
        return {}
    if r.status_code != 200:
        return {}
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


async def run(args: argparse.Namespace) -> dict[str, Any]:
    warmup: list[Prompt] = []
    prompts: list[Prompt]
    if args.workload == "cached-prefix":
        first, prompts = make_cached_prefix(args)
        warmup = [first]
        args.max_concurrency = 1  # sequential: TTFT of a lone request, nothing queued
    else:
        prompts = list(make_prompts(args))
    limits = httpx.Limits(max_connections=args.max_concurrency or 1000)
    timeout = httpx.Timeout(args.timeout)
    async with httpx.AsyncClient(base_url=args.url, timeout=timeout, limits=limits) as client:
        if args.model is None:
            args.model = (await client.get("/v1/models")).json()["data"][0]["id"]
        for prompt in warmup:  # not measured; /metrics deltas start after it
            if not (res := await one_request(client, args, prompt)).ok:
                raise RuntimeError(f"warm-up request failed: {res.error}")
        before = await scrape(client)
        sem = asyncio.Semaphore(args.max_concurrency or len(prompts))
        rng = random.Random(args.seed + 1)

        async def limited(prompt: str) -> Result:
            async with sem:
                return await one_request(client, args, prompt)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if args.request_rate != float("inf"):  # Poisson arrivals
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = await scrape(client)
    return summarize(args, results, duration, before, after)


def _pcts(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    qs = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"mean": statistics.fmean(values), "p50": qs[49], "p90": qs[89], "p99": qs[98]}


def summarize(
    args: argparse.Namespace,
    results: list[Result],
    duration: float,
    before: dict[str, float],
    after: dict[str, float],
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    server_hit = None
    if _PD_PROMPT in after:
        d_prompt = after[_PD_PROMPT] - before.get(_PD_PROMPT, 0.0)
        d_cached = after.get(_PD_CACHED, 0.0) - before.get(_PD_CACHED, 0.0)
        server_hit = d_cached / d_prompt if d_prompt else None
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "label": args.label,
        "config": {
            k: _finite(v) for k, v in vars(args).items() if k not in ("json", "label", "launch")
        },
        "num_requests": len(results),
        "num_failed": len(results) - len(ok),
        "errors": errors[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "cache_hit_rate_usage": (sum(r.cached_tokens for r in ok) / prompt_tokens)
        if prompt_tokens
        else None,
        "cache_hit_rate_metrics": server_hit,
        "ttft_s": _pcts([r.ttft for r in ok]),
        "tpot_s": _pcts([t for r in ok if (t := r.tpot) is not None]),
        "itl_s": _pcts([x for r in ok for x in r.itls]),
        "e2e_s": _pcts([r.e2e for r in ok]),
    }


def _finite(v: Any) -> Any:
    return None if v == float("inf") else v  # JSON has no Infinity


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def markdown(s: dict[str, Any]) -> str:
    lines = [
        f"### {s['label'] or s['config']['workload']}: {s['num_requests']} requests "
        f"({s['num_failed']} failed) in {s['duration_s']:.2f} s",
        "",
        "| latency (ms) | mean | p50 | p90 | p99 |",
        "|---|---:|---:|---:|---:|",
    ]
    for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        p = s[key]
        lines.append(
            f"| {name} | {_ms(p['mean'])} | {_ms(p['p50'])} | {_ms(p['p90'])} | {_ms(p['p99'])} |"
        )
    lines += [
        "",
        "| throughput / cache | value |",
        "|---|---:|",
        f"| requests/s | {s['request_throughput']:.2f} |",
        f"| output tokens/s | {s['output_throughput']:.1f} |",
        f"| prompt / output tokens | {s['prompt_tokens']} / {s['output_tokens']} |",
        f"| cache hit rate (usage) | {_rate(s['cache_hit_rate_usage'])} |",
        f"| cache hit rate (/metrics) | {_rate(s['cache_hit_rate_metrics'])} |",
    ]
    if s["errors"]:
        lines += ["", "errors: " + "; ".join(s["errors"])]
    return "\n".join(lines)


def _ratio(v: float | None, first: float | None) -> str:
    return "-" if v is None or not first else f"{v / first:.2f}×"


def compare_markdown(rows: list[tuple[str, dict[str, Any] | None]]) -> str:
    """One row per launch (None: it did not start), with ratios to the first row."""
    lines = [
        "| run | ok / sent | TTFT p50 | TTFT p90 | TTFT p99 | TPOT p50 | ITL p50 | E2E p50 "
        "| E2E p99 | req/s | out tok/s | hit rate (usage) | hit rate (/metrics) "
        "| TTFT p50 vs first | hit rate vs first |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    first = rows[0][1] if rows else None

    def hit(s: dict[str, Any] | None) -> float | None:
        if s is None:
            return None
        m = s["cache_hit_rate_metrics"]
        return m if m is not None else s["cache_hit_rate_usage"]

    for label, s in rows:
        if s is None:
            lines.append(f"| {label} | did not start |" + " |" * 13)
            continue
        t, e = s["ttft_s"], s["e2e_s"]
        ok = s["num_requests"] - s["num_failed"]
        cells = [
            label, f"{ok} / {s['num_requests']}",
            _ms(t["p50"]), _ms(t["p90"]), _ms(t["p99"]),
            _ms(s["tpot_s"]["p50"]), _ms(s["itl_s"]["p50"]), _ms(e["p50"]), _ms(e["p99"]),
            f"{s['request_throughput']:.2f}", f"{s['output_throughput']:.1f}",
            _rate(s["cache_hit_rate_usage"]), _rate(s["cache_hit_rate_metrics"]),
            _ratio(t["p50"], first["ttft_s"]["p50"] if first else None),
            _ratio(hit(s), hit(first)),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(["latencies in ms", "", *lines])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (no /v1)")
    p.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    p.add_argument(
        "--workload", choices=("shared-prefix", "fixed", "cached-prefix"), default="shared-prefix"
    )
    p.add_argument("--num-groups", type=int, default=4)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=32, help="fixed and cached-prefix")
    p.add_argument("--prefix-len", type=int, default=256, help="words, or tokens with --tokenizer")
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument(
        "--tokenizer", default=None, help="HF tokenizer dir: prompts of random token ids"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s, Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="", help="name of this run in the table and JSON")
    p.add_argument("--json", default=None, help="also write the summary to this file ('-': stdout)")
    p.add_argument(
        "--launch",
        action="append",
        default=None,
        metavar="[LABEL=]ARGS",
        help="start `pd serve ARGS` on a free port and benchmark it (repeatable; --url unused)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.launch:
        return main_launch(args)
    args.url = args.url.rstrip("/").removesuffix("/v1")
    summary = asyncio.run(run(args))
    print(markdown(summary))
    _write_json(args.json, summary)
    return 1 if summary["num_failed"] == summary["num_requests"] else 0


def main_launch(args: argparse.Namespace) -> int:
    launches = [parse_launch(spec) for spec in args.launch]  # bad specs fail before any start
    rows: list[tuple[str, dict[str, Any] | None]] = []
    for launch in launches:
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
    _write_json(args.json, [s for _, s in rows])
    return 0 if all(s is not None and s["num_failed"] == 0 for _, s in rows) else 1


def _write_json(path: str | None, data: Any) -> None:
    if path == "-":
        json.dump(data, sys.stdout, indent=2)
    elif path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
