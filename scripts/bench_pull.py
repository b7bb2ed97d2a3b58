"""Pull vs recompute: a warm conversation sent to the prefill node that lacks its prefix.

Two runs of ``pd serve --prefill 2 --decode 1`` on the default model, one after the other, with
``--policy least_load`` (routing by load alone: each conversation's second turn lands on the
other prefill node, the one whose cache is emptier) and ``--local-prefill-tokens -1`` (every
prefill on the prefill side):

- ``pull``: the defaults otherwise: that node pulls the first turn's KV (a ~1,000-token
  prefix) from the node holding it, when the coordinator estimates that faster;
- ``recompute``: ``--pull-min-tokens -1``: it computes the prefix again.

Each run: a warm-up request (the rates the coordinator estimates from), then ``--conversations``
conversations of two turns (turn 1: ``--prefix-tokens`` random token ids and a short question;
turn 2: turn 1, its answer and a new question), one at a time. Printed: TTFT of the second turns
in both runs, and the pull run's decision log (both estimates, the pull's measured time: from
the request's arrival at the node to the prefix in its cache), beside the compute time of the
same tokens measured in the same run (the prefill rate the nodes report).

    python scripts/bench_pull.py [--conversations 6] [--prefix-tokens 1000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Any

import httpx

from pdtools.bench_client import generate_ttft
from pdtools.bench_launch import Launch, launched

BASE = ["--prefill", "2", "--decode", "1", "--policy", "least_load", "--local-prefill-tokens", "-1"]


def _run(label: str, extra: list[str], args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)  # the same prompts in both runs
    turn2_ttft, answers = [], []
    with launched(Launch(label, BASE + extra)) as url:
        warmup = [rng.randrange(1000, 40000) for _ in range(200)]
        generate_ttft(url, warmup, 4)  # measures the rates
        time.sleep(1.0)  # the nodes' stats reach the coordinator a few times a second
        for _ in range(args.conversations):
            turn1 = [rng.randrange(1000, 40000) for _ in range(args.prefix_tokens + 16)]
            _, out1 = generate_ttft(url, turn1, 8)
            time.sleep(0.5)  # turn 1's cache events reach the coordinator
            turn2 = turn1 + out1 + [rng.randrange(1000, 40000) for _ in range(16)]
            t, out2 = generate_ttft(url, turn2, 8)
            turn2_ttft.append(t)
            answers.append(out2)
        time.sleep(1.0)
        pools = httpx.get(f"{url}/admin/nodes", timeout=30).json()
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    tokens = seconds = 0.0
    for line in metrics.splitlines():
        if line.startswith("pd_node_prefill_tokens{"):
            tokens += float(line.rsplit(" ", 1)[1])
        elif line.startswith("pd_node_prefill_seconds{"):
            seconds += float(line.rsplit(" ", 1)[1])
    return {
        "ttft": turn2_ttft,
        "answers": answers,
        "pulls": pools.get("pulls") or {},
        "prefill_tokens_per_s": tokens / seconds if seconds else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--prefix-tokens", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    pull = _run("pull", [], args)
    recompute = _run("recompute", ["--pull-min-tokens", "-1"], args)
    same = pull["answers"] == recompute["answers"]
    ms = lambda xs: f"{statistics.median(xs) * 1000:.0f} ms" if xs else "-"  # noqa: E731
    print(f"second turns ({args.conversations}, prefix ~{args.prefix_tokens} tokens):")
    print(
        f"  TTFT p50 with pulls:      {ms(pull['ttft'])}  {[round(t * 1000) for t in pull['ttft']]}"
    )
    print(
        f"  TTFT p50 recomputing:     {ms(recompute['ttft'])}  {[round(t * 1000) for t in recompute['ttft']]}"
    )
    print(
        f"  TTFT ratio recompute / pull: {statistics.median(recompute['ttft']) / statistics.median(pull['ttft']):.2f}x"
    )
    print(f"  greedy answers identical in both runs: {same}")
    log = pull["pulls"]
    decisions = [d for d in log.get("decisions", []) if d["num_tokens"] >= args.prefix_tokens // 2]
    pulled = [d for d in decisions if d["choice"] == "pull" and d["error"] is None and d["pull_s"]]
    rate = pull["prefill_tokens_per_s"]
    print(
        f"decision log of the pull run ({log.get('num_pulls', 0)} pulls, "
        f"{log.get('num_fallbacks', 0)} fell back, {log.get('num_computed', 0)} computed):"
    )
    for d in decisions:
        took = "-" if d["pull_s"] is None else f"{d['pull_s'] * 1000:.0f} ms"
        measured = d["num_tokens"] / rate * 1000 if rate else float("nan")
        print(
            f"  {d['num_tokens']} tokens {d['holder']} -> {d['node']}: estimated pull "
            f"{d['est_pull_s'] * 1000:.0f} ms vs compute {d['est_compute_s'] * 1000:.0f} ms -> "
            f"{d['choice']}; pull took {took}, computing them takes {measured:.0f} ms "
            f"at the measured {rate:.0f} tokens/s{' (' + d['error'] + ')' if d['error'] else ''}"
        )
    if pulled and rate:
        pull_s = statistics.median(d["pull_s"] for d in pulled)
        compute_s = statistics.median(d["num_tokens"] / rate for d in pulled)
        print(f"pull p50 {pull_s * 1000:.0f} ms vs computing the same tokens {compute_s * 1000:.0f} ms: "
              f"pull {compute_s / pull_s:.1f}x faster")  # fmt: skip
    return 0 if same and pulled else 1


if __name__ == "__main__":
    sys.exit(main())
