"""A load generator for the overload tests, run as a separate process (so its work does not
share the server's GIL). Prints one JSON object: status counts and the latencies of 200s.

    flood_client.py URL --limit L --rounds R --duration S   unloaded and flood phases
    flood_client.py URL --concurrency N --duration S        N steady clients
    flood_client.py URL --big-bodies MB --duration S        oversized bodies
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx

BODY = {"prompt": [1000 + 37 * i for i in range(24)], "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}  # fmt: skip


async def _clients(http: httpx.AsyncClient, concurrency: int, duration_s: float) -> dict[str, Any]:
    """``concurrency`` closed-loop clients for ``duration_s``: status counts, 200 latencies."""
    statuses: Counter[int] = Counter()
    latencies: list[float] = []
    end = time.monotonic() + duration_s

    async def client() -> None:
        while time.monotonic() < end:
            start = time.perf_counter()
            try:
                r = await http.post("/v1/completions", json=BODY)
            except httpx.HTTPError as e:
                statuses[-1] += 1
                print(f"transport error: {e!r}", flush=True)
                continue
            statuses[r.status_code] += 1
            if r.status_code == 200:
                latencies.append(time.perf_counter() - start)
            elif r.status_code == 429:  # as the openai client: Retry-After, jittered
                await asyncio.sleep(float(r.headers["retry-after"]) * (0.5 + random.random()))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return {"statuses": dict(statuses), "latencies": latencies}


async def _server_e2e(http: httpx.AsyncClient) -> tuple[float, float]:
    """(sum, count) of the server's e2e histogram (admission to finish, as it saw them)."""
    text = (await http.get("/metrics")).text
    values = dict(line.split(" ", 1) for line in text.splitlines() if line.startswith("pd_e2e"))
    prefix = "pd_e2e_request_latency_seconds"
    return float(values[f"{prefix}_sum"]), float(values[f"{prefix}_count"])


async def _phase(http: httpx.AsyncClient, concurrency: int, duration_s: float) -> dict[str, Any]:
    """A phase of ``_clients``, with the mean server-side latency of its 200s."""
    sum0, count0 = await _server_e2e(http)
    out = await _clients(http, concurrency, duration_s)
    sum1, count1 = await _server_e2e(http)
    out["server_mean"] = (sum1 - sum0) / max(count1 - count0, 1)
    return out


async def flood(url: str, limit: int, rounds: int, phase_s: float) -> list[dict[str, Any]]:
    """Rounds of two phases: ``limit`` clients (unloaded: each is admitted at once), then
    ``10 * limit`` clients (a flood). Adjacent phases see the same background load."""
    pool = httpx.Limits(max_connections=10 * limit, max_keepalive_connections=10 * limit)
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=pool) as http:
        await _clients(http, limit, 1.0)  # warm-up
        for _ in range(rounds):
            unloaded = await _phase(http, limit, phase_s)
            flooded = await _phase(http, 10 * limit, phase_s)
            out.append({"unloaded": unloaded, "flood": flooded})
    return out


async def steady(url: str, concurrency: int, duration_s: float) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        return await _clients(http, concurrency, duration_s)


async def big_bodies(url: str, megabytes: int, duration_s: float) -> dict[str, Any]:
    """For ``duration_s`` (each kind at least once): a body of ``megabytes`` MB with
    Content-Length, the same chunked, and a 6 MB one under the server's default cap (parsed,
    then refused). The statuses, error codes and seconds of each kind."""
    huge = json.dumps({"prompt": "x" * (megabytes << 20)}).encode()
    parsed = json.dumps({"prompt": "y" * (6 << 20)}).encode()

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(huge), 1 << 16):
            yield huge[i : i + (1 << 16)]

    out: dict[str, list[Any]] = {"declared": [], "chunked": [], "parsed": []}
    end = time.monotonic() + duration_s
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        headers = {"content-type": "application/json"}
        while time.monotonic() < end or not out["parsed"]:
            for name, content in (("declared", huge), ("chunked", chunks()), ("parsed", parsed)):
                start = time.perf_counter()
                r = await http.post("/v1/completions", content=content, headers=headers)
                code = r.json()["error"]["code"] if r.status_code != 200 else None
                out[name].append((r.status_code, code, time.perf_counter() - start))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--limit", type=int, default=1, help="the server's in-flight limit")
    parser.add_argument("--concurrency", type=int, default=0, help="steady clients; 0: rounds")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--duration", type=float, default=1.0, help="seconds per phase")
    parser.add_argument("--big-bodies", type=int, default=0, help="MB per body; 0: flood")
    args = parser.parse_args()
    if args.big_bodies:
        result = asyncio.run(big_bodies(args.url, args.big_bodies, args.duration))
    elif args.concurrency:
        result = asyncio.run(steady(args.url, args.concurrency, args.duration))
    else:
        result = asyncio.run(flood(args.url, args.limit, args.rounds, args.duration))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
