"""Prefix-cache benchmark: token-level radix cache vs block-hash caching, like with like.

(a) TTFT warm vs cold on the real model: ``bench_ttft_warm_vs_cold`` (the engine's part, not
    here yet; ``--ttft`` runs it).
(b) RadixCache hit rate and tree operations per second (match + insert) on two generated
    workloads (random token ids, fixed seed):
    - shared-prefix: 64 groups x 16 prompts, a 1,024-token prefix per group + a 64-256-token
      question, in shuffled order;
    - multi-turn: 64 conversations x 8 turns after a 256-token shared system prompt; each turn
      re-sends the whole history (user messages 64-256 tokens, answers 32-128) plus a new message,
      conversations interleaved turn by turn.
(c) BlockHashCache (vLLM-style) hit rate on the same workloads at the same token capacity.

Each request matches ``prompt[:-1]`` (the last prompt token is always computed), takes slots for
prompt + answer, evicting LRU under pressure, and on finish hands back prompt + answer less the
last sampled token (whose KV is never computed). Hit rate = matched tokens / prompt tokens.

    python scripts/bench_cache.py [--capacity 16384 65536 262144] [--page-size 1 16]
                                  [--block-size 16] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import time
from typing import NamedTuple

from pd.engine.kv_pool import SlotAllocator
from prefill.block_hash_cache import BlockHashCache
from prefill.radix_cache import RadixCache

VOCAB = 49152  # SmolLM2's vocabulary


class Request(NamedTuple):
    prompt: list[int]
    output: list[int]


class Row(NamedTuple):
    workload: str
    cache: str
    capacity: int
    num_requests: int  # requests that fit (a request larger than the capacity is skipped)
    num_prompt_tokens: int
    num_hit_tokens: int
    num_evicted_tokens: int
    ops_per_s: float | None  # match + insert calls per second, radix only

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


def _ids(rng: random.Random, lo: int, hi: int | None = None) -> list[int]:
    n = lo if hi is None else rng.randint(lo, hi)
    return [rng.randrange(VOCAB) for _ in range(n)]


def shared_prefix_workload(rng: random.Random) -> list[Request]:
    requests = []
    for _ in range(64):
        prefix = _ids(rng, 1024)
        requests += [Request(prefix + _ids(rng, 64, 256), _ids(rng, 32, 128)) for _ in range(16)]
    rng.shuffle(requests)
    return requests


def multi_turn_workload(rng: random.Random) -> list[Request]:
    system = _ids(rng, 256)
    histories = [list(system) for _ in range(64)]
    requests = []
    for _ in range(8):
        for history in histories:
            history += _ids(rng, 64, 256)
            answer = _ids(rng, 32, 128)
            requests.append(Request(list(history), answer))
            history += answer
    return requests


def run_radix(workload: str, requests: list[Request], capacity: int, page_size: int) -> Row:
    allocator = SlotAllocator(capacity, page_size)
    cache = RadixCache(allocator)
    num_done = num_prompt = num_hit = num_ops = 0
    op_seconds = 0.0
    for prompt, output in requests:
        tokens = prompt + output[:-1]
        t0 = time.perf_counter()
        m = cache.match_prompt(prompt)
        op_seconds += time.perf_counter() - t0
        cache.inc_lock_ref(m.last_node)
        if not cache.make_room(allocator.num_new_pages(m.slots, len(tokens)) * page_size):
            cache.dec_lock_ref(m.last_node)
            continue
        slots = allocator.extend(m.slots, len(tokens))
        t0 = time.perf_counter()
        cache.cache_finished(tokens, slots, m.last_node)
        op_seconds += time.perf_counter() - t0
        num_done += 1
        num_prompt += len(prompt)
        num_hit += m.num_tokens
        num_ops += 2
    cache.check_integrity()
    cache.check_slot_ownership([])
    name = f"radix page={page_size}"
    evicted = cache.stats.num_evicted_tokens
    return Row(
        workload, name, capacity, num_done, num_prompt, num_hit, evicted, num_ops / op_seconds
    )


def run_block_hash(workload: str, requests: list[Request], capacity: int, block_size: int) -> Row:
    cache = BlockHashCache(capacity, block_size)
    num_done = num_prompt = num_hit = 0
    for prompt, output in requests:
        tokens = prompt + output[:-1]
        m = cache.match_prefix(prompt[:-1])
        blocks = cache.allocate(m, len(tokens))
        if blocks is None:
            continue
        cache.free(tokens, blocks)
        num_done += 1
        num_prompt += len(prompt)
        num_hit += m.num_tokens
    cache.check_integrity()
    name = f"block-hash block={block_size}"
    evicted = cache.stats.num_evicted_tokens
    return Row(workload, name, capacity, num_done, num_prompt, num_hit, evicted, None)


def bench_ttft_warm_vs_cold(args: argparse.Namespace) -> list[str]:
    """Part (a): TTFT of a prompt whose prefix is cached (warm) vs not (cold), on the real model
    through the engine. Returns markdown table lines. To be written with the engine."""
    raise SystemExit("part (a) (TTFT warm vs cold) is not implemented yet: it needs the engine")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--capacity",
        type=int,
        nargs="+",
        default=[16384, 65536, 262144],
        help="cache capacity in tokens (KV slots), one run per value",
    )
    ap.add_argument("--page-size", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttft", action="store_true", help="also run part (a) on the real model")
    args = ap.parse_args()

    workloads = {
        "shared-prefix": shared_prefix_workload(random.Random(args.seed)),
        "multi-turn": multi_turn_workload(random.Random(args.seed)),
    }
    print(
        "| workload | cache | capacity (tokens) | requests | prompt tokens | hit rate "
        "| evicted tokens | match+insert ops/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, requests in workloads.items():
        for capacity in args.capacity:
            rows = [run_radix(name, requests, capacity, ps) for ps in args.page_size]
            rows.append(run_block_hash(name, requests, capacity, args.block_size))
            for r in rows:
                ops = f"{r.ops_per_s:,.0f}" if r.ops_per_s is not None else "-"
                print(
                    f"| {r.workload} | {r.cache} | {r.capacity:,} | {r.num_requests} "
                    f"| {r.num_prompt_tokens:,} | {r.hit_rate:.1%} | {r.num_evicted_tokens:,} "
                    f"| {ops} |",
                    flush=True,
                )
    if args.ttft:
        for line in bench_ttft_warm_vs_cold(args):
            print(line)


if __name__ == "__main__":
    main()
