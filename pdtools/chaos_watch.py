"""What ``scripts/chaos_soak.py`` runs beside its faults: a wait for the server to be ready, the
steady clients, the server's and each node's memory sampled, ``GET /health`` timed, and the
leak checks polled until they settle.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import time
from typing import Any

import httpx

from pdtools.chaos_cluster import Api, Monitor, Pools, ProcessTree, ServeProcess, rss_mib
from pdtools.chaos_load import Outcome, References, send
from pdtools.chaos_report import Check, leak_checks


async def wait_ready(api: Api, server: ServeProcess | None, timeout_s: float = 300.0) -> Pools:
    """The pools, once the server is ready, no node starts or drains, and every node has
    reported its stats (its idle threads are the baseline of a leak check)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if server is not None and server.proc.poll() is not None:
            raise RuntimeError(f"pd serve exited ({server.proc.returncode}):\n{server.tail()}")
        try:
            ready, _ = await api.readiness()
            if ready:
                pools = await api.pools()
                if pools.is_whole(pools.target) and all(n["threads"] for n in pools.nodes):
                    return pools
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not ready within {timeout_s:g} s")
        await asyncio.sleep(1.0)


async def steady(
    http: httpx.AsyncClient,
    api: Api,
    refs: References,
    seed: int,
    until: float,
    deadline_s: float,
    outcomes: list[Outcome],
) -> None:
    """One steady client: a request at a time, as the openai client would (a 429 waits its
    Retry-After, jittered)."""
    rng = random.Random(seed)
    while time.monotonic() < until:
        out = await send(http, rng.choice(refs.specs), api.headers(), deadline_s)
        outcomes.append(out)
        if out.status == 429:
            await asyncio.sleep(0.5 + rng.random())


async def sample_rss(pid: int | None, samples: list[tuple[float, float]]) -> None:
    while pid is not None and (rss := rss_mib(pid)) is not None:
        samples.append((time.monotonic(), rss))
        await asyncio.sleep(5.0)


HEALTH_EVERY_S = 0.25
HEALTH_TIMEOUT_S = 10.0  # a probe unanswered this long counts as this long


async def probe_health(url: str, samples: list[tuple[float, float]]) -> None:
    """``GET /health`` every ``HEALTH_EVERY_S`` on a connection of its own each time (as a
    load balancer's check): (when, seconds to its answer) in ``samples``; an error or no
    answer counts as ``HEALTH_TIMEOUT_S``."""
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits) as http:
        while True:
            start = time.monotonic()
            try:
                r = await http.get("/health", timeout=HEALTH_TIMEOUT_S)
                took = time.monotonic() - start if r.status_code == 200 else HEALTH_TIMEOUT_S
            except httpx.HTTPError:
                took = HEALTH_TIMEOUT_S
            samples.append((start, took))
            await asyncio.sleep(max(0.0, HEALTH_EVERY_S - (time.monotonic() - start)))


def _probe_health_process(url: str, out: Any) -> None:
    """A process's whole job: ``probe_health``, each sample sent on ``out`` (a pipe's end)."""

    class Sink(list):  # type: ignore[type-arg]
        def append(self, sample: tuple[float, float]) -> None:
            out.send(sample)

    asyncio.run(probe_health(url, Sink()))


class HealthProber:
    """``probe_health`` in a process of its own, as a load balancer probes from outside: the
    soak's own loop (its floods, its junk frames, its thousands of requests) never delays a
    probe, so a slow probe is the server's. Times are ``time.monotonic()``, one clock for
    every process of the machine."""

    def __init__(self, url: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_probe_health_process, args=(url, send), daemon=True)
        self._proc.start()
        send.close()
        self.samples: list[tuple[float, float]] = []

    def stop(self) -> list[tuple[float, float]]:
        """End the process; every sample it took."""
        self._proc.terminate()
        self._proc.join(timeout=10)
        while self._recv.poll():
            try:
                self.samples.append(self._recv.recv())
            except (EOFError, OSError):
                break
        self._recv.close()
        return self.samples


async def sample_node_rss(
    monitor: Monitor, tree: ProcessTree, samples: dict[str, list[tuple[float, float]]]
) -> None:
    """Every node's RSS (MiB) every 5 s, by node id (the soak's own processes only)."""
    while True:
        for n in monitor.pools.nodes if monitor.pools else []:
            if tree.owns(n["pid"]) and (rss := rss_mib(n["pid"])) is not None:
                samples.setdefault(n["id"], []).append((time.monotonic(), rss))
        await asyncio.sleep(5.0)


async def settle(
    api: Api, sizes: dict[str, int], idle_threads: dict[str, int], timeout_s: float
) -> tuple[list[Check], Pools]:
    """The leak checks, polled until they pass or ``timeout_s`` passes (the last result)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pools, metrics = await api.pools(), await api.metrics()
            checks = leak_checks(pools, metrics, sizes, idle_threads)
            if all(c.ok for c in checks) or time.monotonic() > deadline:
                return checks, pools
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(1.0)
