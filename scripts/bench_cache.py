"""Prefix-cache benchmark: token-level radix cache vs block-hash caching, like with like.

(a) TTFT warm vs cold on the real model through the colocated Engine (``Engine``): a
    request of a 2,048-token prefix + 64 new tokens, timed from ``add_request`` to its first
    token. Cold: a cache-off engine prefills all 2,112 tokens. Warm: a cache-on engine has
    ``warmup([prefix])`` first and prefills only the 64 new tokens. Median of 3 prompts (fresh
    random ids each, same prompts both ways; the first tokens must agree).
(b) RadixCache hit rate and tree operations per second (match + insert) on two generated
    workloads (random token ids, fixed seed):
    - shared-prefix: 64 groups x 16 prompts, a 1,024-token prefix per group + a 64-256-token
      question, in shuffled order;
    - multi-turn: 64 conversations x 8 turns after a 256-token shared system prompt; each turn
      re-sends the whole history (user messages 64-256 tokens, answers 32-128) plus a new message,
      conversations interleaved turn by turn.
(c) BlockHashCache (vLLM-style) hit rate on the same workloads at the same token capacity.
(d) TTFT by tier on the real model: a prefix served from the device pool, the host tier, the
    disk tier, and a fresh engine on the same disk directory, beside cold (cache off).

Each request matches ``prompt[:-1]`` (the last prompt token is always computed), takes slots for
prompt + answer, evicting LRU under pressure, and on finish hands back prompt + answer less the
last sampled token (whose KV is never computed). Hit rate = matched tokens / prompt tokens.

    python scripts/bench_cache.py [--parts a b c d] [--capacity 16384 65536 262144]
                                  [--page-size 1 16] [--block-size 16] [--seed 0]
                                  [--model M] [--prefix-len 2048] [--new-len 64] [--repeats 3]
                                  [--num-threads N]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import NamedTuple

import torch

from pd.cache.radix_cache import RadixCache
from pd.core.kv_pool import SlotAllocator
from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from pdtools.block_hash_cache import BlockHashCache

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


def time_to_first_token(engine: Engine, prompt: list[int]) -> tuple[float, int, int]:
    """Seconds from ``add_request`` to the first output, that token, and the cached tokens."""
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while True:
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                seconds = time.perf_counter() - t0
                assert out.finished and not engine.has_unfinished
                return seconds, out.new_token_ids[0], out.num_cached_tokens


def bench_ttft_warm_vs_cold(args: argparse.Namespace) -> list[str]:
    """Part (a): markdown table lines of TTFT cold (cache off) vs warm (prefix cached)."""
    n = args.prefix_len + args.new_len
    cfg = EngineConfig(model=args.model, max_total_tokens=2 * n + 64, num_threads=args.num_threads)
    cold_engine = Engine(dataclasses.replace(cfg, enable_prefix_cache=False))
    warm_engine = Engine(cfg)
    rng = random.Random(args.seed)
    for engine in (cold_engine, warm_engine):  # first-call overheads stay out of the timings
        engine.generate([_ids(rng, 64)], SamplingParams(max_tokens=2, temperature=0.0))
    cold, warm = [], []
    for _ in range(args.repeats):
        prefix = _ids(rng, args.prefix_len)
        prompt = prefix + _ids(rng, args.new_len)
        cold_s, cold_token, cold_cached = time_to_first_token(cold_engine, prompt)
        warm_engine.warmup([prefix])
        warm_s, warm_token, warm_cached = time_to_first_token(warm_engine, prompt)
        assert cold_cached == 0 and warm_cached == args.prefix_len, (cold_cached, warm_cached)
        assert warm_token == cold_token, f"warm first token {warm_token} != cold {cold_token}"
        cold.append(cold_s)
        warm.append(warm_s)
    for engine in (cold_engine, warm_engine):
        engine.check_integrity()
    runner = warm_engine.runner
    lines = [
        f"TTFT on {runner.model_dir.name} ({runner.device}, {runner.dtype}, "
        f"{torch.get_num_threads()} threads), max_prefill_tokens={cfg.max_prefill_tokens}, "
        f"median of {args.repeats}",
        "",
        "| case | prompt tokens | cached tokens | computed tokens | TTFT median (ms) | runs (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for name, times, cached in (("cold", cold, 0), ("warm", warm, args.prefix_len)):
        runs = ", ".join(f"{t * 1e3:.1f}" for t in times)
        lines.append(
            f"| {name} | {n:,} | {cached:,} | {n - cached:,} "
            f"| {statistics.median(times) * 1e3:.1f} | {runs} |"
        )
    ratio = statistics.median(cold) / statistics.median(warm)
    lines += ["", f"warm is {ratio:.1f}x faster to the first token (target >= 10x)"]
    return lines


def bench_ttft_tiers(args: argparse.Namespace) -> list[str]:
    """Part (d): TTFT of a prompt whose prefix is served from each tier, beside cold (cache
    off), on one pool that holds one request: the device pool (just used), the host tier
    (pushed out of the pool by one other request), the disk tier (pushed out of the pool and
    the host tier too), and a fresh engine on the same disk directory (a node replaced on the
    same host; the prefix was reused before, so it was written through). Each first token
    must equal cold's."""
    n = args.prefix_len + args.new_len
    pool = n + 64
    base = EngineConfig(model=args.model, max_total_tokens=pool, num_threads=args.num_threads)
    disk_dir = tempfile.mkdtemp(prefix="pd-bench-disk-")
    cold_engine = Engine(dataclasses.replace(base, enable_prefix_cache=False))
    host_engine = Engine(dataclasses.replace(base, host_cache_tokens=8 * pool))
    disk_cfg = dataclasses.replace(base, host_cache_tokens=pool, disk_cache_dir=disk_dir)
    disk_engine = Engine(disk_cfg)
    rng = random.Random(args.seed)
    for engine in (cold_engine, host_engine, disk_engine):  # first-call overheads
        engine.generate([_ids(rng, 64)], SamplingParams(max_tokens=2, temperature=0.0))
    times: dict[str, list[float]] = {k: [] for k in ("cold", "device", "host", "disk", "restart")}
    cached: dict[str, int] = {}

    def timed(case: str, engine: Engine, prompt: list[int]) -> None:
        seconds, token, num_cached = time_to_first_token(engine, prompt)
        _, want, _ = time_to_first_token(cold_engine, prompt)
        assert token == want, f"{case}: first token {token} != cold {want}"
        times[case].append(seconds)
        cached[case] = num_cached

    def filler() -> None:  # another request of the pool's size
        time_to_first_token(host_engine, _ids(rng, n))

    for _ in range(args.repeats):
        prefix = _ids(rng, args.prefix_len)
        prompt = [prefix + _ids(rng, args.new_len) for _ in range(5)]
        timed("cold", cold_engine, prompt[0])
        time_to_first_token(host_engine, prompt[0])
        timed("device", host_engine, prompt[1])
        filler()
        timed("host", host_engine, prompt[2])
        time_to_first_token(disk_engine, prompt[0])
        time_to_first_token(disk_engine, prompt[1])  # reused: written through to disk
        for _ in range(3):  # out of the pool and the host tier
            time_to_first_token(disk_engine, _ids(rng, n))
        disk_engine.cache.lower.disk.flush()  # the writer thread's chunks are on disk
        timed("disk", disk_engine, prompt[3])
        restarted = Engine(dataclasses.replace(disk_cfg, host_cache_tokens=8 * pool))
        timed("restart", restarted, prompt[4])
    for engine in (cold_engine, host_engine, disk_engine):
        engine.check_integrity()
    host, disk = host_engine.cache.tier_stats, disk_engine.cache.tier_stats.disk
    runner = host_engine.runner
    cold_s = statistics.median(times["cold"])
    lines = [
        f"TTFT by tier on {runner.model_dir.name} ({runner.device}, {runner.dtype}, "
        f"{torch.get_num_threads()} threads), {args.prefix_len:,}-token prefix + "
        f"{args.new_len} new tokens, a {pool:,}-slot pool, median of {args.repeats}",
        "",
        "| prefix served from | cached tokens | TTFT median (ms) | x cold | runs (ms) |",
        "|---|---|---|---|---|",
    ]
    for case, t in times.items():
        runs = ", ".join(f"{x * 1e3:.1f}" for x in t)
        med = statistics.median(t)
        lines.append(
            f"| {case} | {cached.get(case, 0):,} | {med * 1e3:.1f} | {med / cold_s:.3f} | {runs} |"
        )
    lines += [
        "",
        f"host tier: {host.num_loads} loads, {host.num_load_bytes / 2**20:.1f} MiB in "
        f"{host.load_seconds * 1e3:.1f} ms ({_gbps(host.num_load_bytes, host.load_seconds)}); "
        f"disk tier: {disk.num_loads} chunks, {disk.num_load_bytes / 2**20:.1f} MiB in "
        f"{disk.load_seconds * 1e3:.1f} ms read, checked and copied "
        f"({_gbps(disk.num_load_bytes, disk.load_seconds)}), {disk.num_written} chunks written",
    ]
    shutil.rmtree(disk_dir, ignore_errors=True)
    return lines


def _gbps(num_bytes: int, seconds: float) -> str:
    return f"{num_bytes / seconds / 1e9:.2f} GB/s" if seconds else "-"


def bench_hit_rates(args: argparse.Namespace) -> Iterator[str]:
    """Parts (b) and (c): markdown table lines of radix (b) and block-hash (c) hit rates,
    yielded as each row is measured."""
    workloads = {
        "shared-prefix": shared_prefix_workload(random.Random(args.seed)),
        "multi-turn": multi_turn_workload(random.Random(args.seed)),
    }
    yield (
        "| workload | cache | capacity (tokens) | requests | prompt tokens | hit rate "
        "| evicted tokens | match+insert ops/s |"
    )
    yield "|---|---|---|---|---|---|---|---|"
    for name, requests in workloads.items():
        for capacity in args.capacity:
            rows = []
            if "b" in args.parts:
                rows += [run_radix(name, requests, capacity, ps) for ps in args.page_size]
            if "c" in args.parts:
                rows.append(run_block_hash(name, requests, capacity, args.block_size))
            for r in rows:
                ops = f"{r.ops_per_s:,.0f}" if r.ops_per_s is not None else "-"
                yield (
                    f"| {r.workload} | {r.cache} | {r.capacity:,} | {r.num_requests} "
                    f"| {r.num_prompt_tokens:,} | {r.hit_rate:.1%} | {r.num_evicted_tokens:,} "
                    f"| {ops} |"
                )


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
    ap.add_argument(
        "--parts",
        nargs="+",
        choices=["a", "b", "c", "d"],
        default=["a", "b", "c", "d"],
        help="a: TTFT warm vs cold (real model); b: radix hit rates; c: block-hash hit rates; "
        "d: TTFT by tier (real model)",
    )
    ap.add_argument("--model", default=None, help="part (a)'s model (default: SmolLM2-135M)")
    ap.add_argument("--prefix-len", type=int, default=2048, help="part (a): cached prefix")
    ap.add_argument("--new-len", type=int, default=64, help="part (a): tokens after it")
    ap.add_argument("--repeats", type=int, default=3, help="part (a): prompts timed each way")
    ap.add_argument(
        "--num-threads", type=int, default=None, help="part (a): torch threads (default: torch's)"
    )
    args = ap.parse_args()

    if "b" in args.parts or "c" in args.parts:
        for line in bench_hit_rates(args):
            print(line, flush=True)
        print()
    if "a" in args.parts:
        for line in bench_ttft_warm_vs_cold(args):
            print(line, flush=True)
        print()
    if "d" in args.parts:
        for line in bench_ttft_tiers(args):
            print(line, flush=True)


if __name__ == "__main__":
    main()
