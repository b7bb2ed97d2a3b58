"""TTFT of a prefix after its prefill node is killed and replaced on the same host.

One ``pd serve --prefill 1 --decode 1 --disk-cache-dir DIR`` on the default model (with
``--local-prefill-tokens -1 --pull-min-tokens -1`` unless ``--defaults``: so that no request is
prefilled on, or pulled from, the decode node, which also holds the prefix, and the number
measures what the disk tier gives the replacement). For each of ``--prefixes`` prefixes of
``--prefix-tokens`` random token ids:

1. the first request (cold: TTFT measured), then a second one that reuses the prefix, so it is
   written through to the disk tier;
2. the prefill node is killed (SIGKILL, its pid from ``GET /admin/nodes``: a process the
   launched server started) and ``pd serve`` starts its replacement on this host, which reads
   the directory up and announces what it found;
3. the first request for the prefix on the replacement: its TTFT, beside the cold TTFT of a new
   prefix of the same length on the same node, measured right after (the baseline).

    python scripts/bench_replace.py [--prefixes 3] [--prefix-tokens 1000] [--defaults]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
import time

import httpx

from pdtools.bench_client import generate_ttft
from pdtools.bench_launch import Launch, launched


def _prefill(url: str) -> dict:
    nodes = httpx.get(f"{url}/admin/nodes", timeout=30).json()["nodes"]
    (node,) = [n for n in nodes if n["role"] == "prefill"]
    return node


def _wait_replaced(url: str, old: str, timeout_s: float = 300.0) -> float:
    start = time.monotonic()
    while True:
        try:
            node = _prefill(url)
            ready = httpx.get(f"{url}/ready", timeout=5).status_code == 200
            if node["id"] != old and node["state"] == "ready" and ready:
                return time.monotonic() - start
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"no replacement for {old} within {timeout_s} s")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefixes", type=int, default=3)
    p.add_argument("--prefix-tokens", type=int, default=1000)
    p.add_argument("--defaults", action="store_true", help="leave local prefills and pulls on")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    ids = lambda n: [rng.randrange(1000, 40000) for _ in range(n)]  # noqa: E731
    rows = []
    with tempfile.TemporaryDirectory(prefix="pd-bench-disk-") as disk:
        extra = ["--prefill", "1", "--decode", "1", "--disk-cache-dir", disk]
        if not args.defaults:
            extra += ["--local-prefill-tokens", "-1", "--pull-min-tokens", "-1"]
        with launched(Launch("replace", extra)) as url:
            generate_ttft(url, ids(64), 2)  # the first request of a server pays for its warm-up
            for i in range(args.prefixes):
                prefix = ids(args.prefix_tokens)
                cold, _ = generate_ttft(url, prefix + ids(8), 4)
                generate_ttft(url, prefix + ids(8), 4)  # reused: written through to disk
                time.sleep(2.0)  # the disk writer thread
                old = _prefill(url)
                os.kill(old["pid"], signal.SIGKILL)
                took = _wait_replaced(url, old["id"])
                after, _ = generate_ttft(url, prefix + ids(8), 4)
                baseline, _ = generate_ttft(url, ids(args.prefix_tokens + 8), 4)
                rows.append((cold, after, baseline, took))
                print(
                    f"prefix {i}: cold {cold * 1000:.0f} ms; {old['id']} killed, replaced in "
                    f"{took:.1f} s; first request on the replacement {after * 1000:.0f} ms, "
                    f"a cold prefix there {baseline * 1000:.0f} ms ({after / baseline:.2f}x)",
                    flush=True,
                )
    after = statistics.median(r[1] for r in rows)
    baseline = statistics.median(r[2] for r in rows)
    cold = statistics.median(r[0] for r in rows)
    print(
        f"TTFT p50: first request for a held prefix on the replacement {after * 1000:.0f} ms, "
        f"a cold prefix on it {baseline * 1000:.0f} ms: {after / baseline:.2f}x "
        f"(cold before the kill: {cold * 1000:.0f} ms)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
