"""The front end's own cost: CPU time of the ``pd serve`` process (HTTP, tokenizing, the
coordinator, the nodes' token streams, detokenizing, SSE) per request and per streamed token,
under a load that keeps its nodes busy.

Starts ``pd serve ARGS`` (default ``--prefill 1 --decode 1``: the nodes are Ray actors in
processes of their own, so the server process's CPU time is the front end's alone) and reads
utime+stime of that one process from ``/proc/<pid>/stat`` around each phase:

1. idle: the process's CPU a second with no request (its timers, Ray's driver threads);
2. streamed: ``--requests`` chat requests of ``--max-tokens`` tokens (``ignore_eos``),
   ``--concurrency`` in flight, streamed with usage;
3. non-streamed: the same requests, answered whole;
4. one at a time: ``--serial`` streamed requests, one in flight (how a new user measures it).

Printed per phase: CPU ms, CPU ms per request and per output token (everything the process did
in the phase, idle time included; and less the idle rate times the phase's wall time), tokens/s
served, the process's share of a core, and the tokens/s one front end could stream on one core
at that cost ((1,000 - idle ms/s) / ms per token less idle: its ceiling). CPU time,
not wall time, is the metric: the machine may be shared. A warm-up round runs first. On a
shared CPU, ``--launch "--prefill 1 --decode 1 --model DIR"`` with a tiny random checkpoint
(``tests/conftest.py``'s ``write_tiny_checkpoint``) streams tokens fast enough that the front
end's work per token, not its idle cost over a slow model's wall time, is what is read.

    python scripts/bench_frontend.py [--launch ARGS] [--requests 24] [--concurrency 8]
        [--max-tokens 128] [--serial 3] [--url URL --pid PID: a server running already]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from contextlib import nullcontext
from typing import Any, NamedTuple

import httpx

from pdtools.bench_launch import launched_process, parse_launch

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads; not its children)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2 :].split()  # fields from the 3rd (state) on
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # fields 14 and 15: utime, stime


class Phase(NamedTuple):
    name: str
    num_requests: int
    num_tokens: int
    cpu_s: float
    wall_s: float

    def row(self, idle_ms_s: float) -> str:
        ms_token = 1e3 * self.cpu_s / max(self.num_tokens, 1)
        busy_ms = 1e3 * self.cpu_s - idle_ms_s * self.wall_s  # less what idling costs
        return (
            f"| {self.name} | {self.num_requests} | {self.num_tokens} | {1e3 * self.cpu_s:.0f} "
            f"| {1e3 * self.cpu_s / max(self.num_requests, 1):.1f} | {ms_token:.3f} "
            f"| {busy_ms / max(self.num_tokens, 1):.3f} | {self.num_tokens / self.wall_s:.0f} "
            f"| {100 * self.cpu_s / self.wall_s:.0f}% "
            f"| {(1e3 - idle_ms_s) * max(self.num_tokens, 1) / max(busy_ms, 1e-9):.0f} |"
        )


HEADER = (
    "| phase | requests | tokens | CPU ms | CPU ms / request | CPU ms / token "
    "| CPU ms / token, less idle | tokens/s | CPU share | tokens/s at one core |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def _body(model: str, i: int, max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": f"Tell me a long story about the number {i}."}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _one(client: httpx.AsyncClient, body: dict[str, Any]) -> int:
    """The request's completion tokens (from its usage)."""
    if not body["stream"]:
        r = await client.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
    return tokens


async def _load(
    url: str, num: int, concurrency: int, max_tokens: int, stream: bool, first: int
) -> int:
    sem = asyncio.Semaphore(concurrency)

    async def run(i: int) -> int:
        async with sem:
            return await _one(client, _body(model, first + i, max_tokens, stream))

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        return sum(await asyncio.gather(*(run(i) for i in range(num))))


def _phase(
    name: str, pid: int, url: str, num: int, concurrency: int, args: argparse.Namespace, **kw: Any
) -> Phase:
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    tokens = asyncio.run(_load(url, num, concurrency, args.max_tokens, **kw))
    phase = Phase(name, num, tokens, cpu_seconds(pid) - cpu0, time.monotonic() - t0)
    print(f"[{name}] {phase.cpu_s:.2f} CPU s in {phase.wall_s:.0f} s", file=sys.stderr, flush=True)
    return phase


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launch", default="--prefill 1 --decode 1", help="pd serve's arguments")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--serial", type=int, default=3, help="streamed requests, one at a time")
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--url", help="measure this running server instead (with --pid)")
    ap.add_argument("--pid", type=int, help="the running server's process (with --url)")
    args = ap.parse_args()
    if (args.url is None) != (args.pid is None):
        ap.error("--url and --pid go together")
    server = (
        nullcontext((args.url, args.pid))
        if args.url is not None
        else launched_process(parse_launch(f"frontend={args.launch}"))
    )
    with server as (url, pid):
        n, c = args.requests, args.concurrency
        _phase("warm-up", pid, url, c, c, args, stream=True, first=10_000)
        cpu0 = cpu_seconds(pid)
        time.sleep(args.idle_s)
        idle_ms_s = 1e3 * (cpu_seconds(pid) - cpu0) / args.idle_s
        phases = [
            _phase(f"streamed, {c} in flight", pid, url, n, c, args, stream=True, first=0),
            _phase(f"non-streamed, {c} in flight", pid, url, n, c, args, stream=False, first=n),
            _phase("streamed, one at a time", pid, url, args.serial, 1, args, stream=True,
                   first=2 * n),
        ]  # fmt: skip
    print(f"pd serve {args.url or args.launch}: idle {idle_ms_s:.1f} CPU ms/s")
    print(HEADER)
    for p in phases:
        print(p.row(idle_ms_s))


if __name__ == "__main__":
    main()
