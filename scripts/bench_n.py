"""``n`` choices against as many separate requests, through the HTTP API of a colocated
server (uvicorn on loopback, the openai client's wire format via httpx): one request of
``n=4`` against 4 requests of the same prompt sent at once (seeds s..s+3, so both sample the
same tokens), each round alternating the two (best round kept). Reported: wall time,
completion tokens a second, prompt tokens the engine computed (its prefix cache's misses:
the prompt's KV computed and held once or n times) and the most KV slots in use at once.

    python scripts/bench_n.py [--model PATH] [--threads 2] [--n 4] [--prompt-len 512]
        [--max-tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
import time
from typing import Any

import httpx
import torch
import uvicorn

# run as a script, scripts/ is on the path: the cpu name of the engine tables
from bench_attention import _cpu_name

from pd.engine.async_engine import AsyncEngine
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from pd.server import build_app


def _serve(app: Any) -> tuple[str, uvicorn.Server, threading.Thread]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


def _stats(client: AsyncEngine) -> Any:
    return client.call(lambda engine: engine.stats())


def _watch(client: AsyncEngine, done: threading.Event, peak: list[int]) -> None:
    """The most slots in use (not free: held by requests or the cache) until ``done``, less
    those in use before: read between engine steps (``client.call``)."""
    base = _stats(client)
    while not done.wait(0.005):
        s = _stats(client)
        peak[0] = max(peak[0], base.num_free_slots - s.num_free_slots)


async def _one_round(url: str, body: dict[str, Any], n: int, together: bool) -> int:
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        if together:
            r = await c.post("/v1/completions", json={**body, "n": n})
            return r.json()["usage"]["completion_tokens"]
        rs = await asyncio.gather(
            *(c.post("/v1/completions", json={**body, "seed": body["seed"] + i}) for i in range(n))
        )
        return sum(r.json()["usage"]["completion_tokens"] for r in rs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = EngineConfig(model=args.model, max_total_tokens=16384)
    client = AsyncEngine(lambda: Engine(cfg))
    engine = client.engine
    app = build_app(
        client, tokenizer=engine.tokenizer, model_name="m", max_model_len=engine.max_model_len
    )
    url, server, thread = _serve(app)
    print(
        f"# {_cpu_name()}, {args.threads} threads, 2026-12-05; n={args.n}, prompt "
        f"{args.prompt_len} tokens, max_tokens {args.max_tokens} (ignore_eos)"
    )
    best: dict[str, tuple[float, int, int, int]] = {}
    try:
        for r in range(args.rounds):
            for together in (True, False):
                name = f"n={args.n}" if together else f"{args.n} separate requests"
                # a prompt of its own each run: nothing cached before it
                prompt = [
                    1000 + (7 * i + 131 * r + 17 * together) % 20000 for i in range(args.prompt_len)
                ]
                body = dict(prompt=prompt, max_tokens=args.max_tokens, temperature=0.8, seed=1,
                            ignore_eos=True)  # fmt: skip
                before = _stats(client)
                peak = [0]
                done = threading.Event()
                watcher = threading.Thread(target=_watch, args=(client, done, peak), daemon=True)
                watcher.start()
                start = time.perf_counter()
                tokens = asyncio.run(_one_round(url, body, args.n, together))
                wall = time.perf_counter() - start
                done.set()
                watcher.join()
                after = _stats(client)
                computed = after.num_miss_tokens - before.num_miss_tokens
                if name not in best or wall < best[name][0]:
                    best[name] = (wall, tokens, computed, peak[0])
        print(
            "| run | wall s | completion tok/s | prompt tokens computed | KV slots taken (peak) |"
        )
        print("|---|---|---|---|---|")
        for name, (wall, tokens, computed, peak_slots) in best.items():
            print(f"| {name} | {wall:.2f} | {tokens / wall:.1f} | {computed} | {peak_slots} |")
    finally:
        server.should_exit = True
        thread.join(10)
        client.shutdown()


if __name__ == "__main__":
    main()
