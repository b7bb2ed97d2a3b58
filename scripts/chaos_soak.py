"""A chaos soak of a pd cluster: steady load with known greedy answers (some without
``max_tokens``) while nodes are killed, frozen and drained, admission is flooded, readers stall
or read slowly, bodies trickle, request heads go silent, hostile input, junk frames and
strangers' connections arrive, the disk tier turns read-only and a forged chunk is planted in
it, and a hostile tenant with a key of its own sends what issue 55 found could freeze the
server, kill nodes or exhaust its memory (``pdtools.chaos_tenant``), on a seeded schedule, while
``/health`` is timed throughout; then, after a quiet period, checks that nothing leaked. Prints a
report (a markdown table for RELIABILITY.md) and exits 1 on any failure.

    python scripts/chaos_soak.py --minutes 30 [--seed S] [--model DIR] [--report PATH]
    python scripts/chaos_soak.py --url http://127.0.0.1:8000 --api-key K [--server-pid PID]

Without ``--url`` it starts ``pd serve --prefill 2 --decode 2`` itself (a session of its own,
ended with every process in it, and a disk tier in a directory of its own) at pd serve's engine
defaults (int4 weights and compiled decode steps on a CPU), ``--engine eager`` (the defaults but
``--compile-buckets off``) or ``--engine fp32-eager`` (``--quantization none --compile-buckets off``),
speculating with ``--speculative-tokens K``, its nodes of ``--tp N`` ranks each (then a rank
of a node is also killed or frozen alone: the node must go down as one and be replaced); with
``--url`` it tests that server, and signals its
nodes only with ``--server-pid`` (only processes under that pid). ``--faults`` runs some of the
faults alone (``--help`` lists them by lane). A wrong answer is reported
with the path that served it (``GET /admin/routes``: its nodes, the prefix expected cached there,
a pull; its cached tokens; the last fault before it). ``--minutes`` counts from the
first request after the reference answers to the report. Exit status: 0 pass, 1 a failure,
2 the soak could not run (no server, unstable reference answers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import shutil
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import httpx

from pdtools.chaos_cluster import ROLES, Api, Monitor, ProcessTree, ServeProcess, serve_flags
from pdtools.chaos_faults import FAULTS, Chaos, Settings
from pdtools.chaos_lanes import lanes
from pdtools.chaos_load import Outcome, long_spec, make_specs, references
from pdtools.chaos_report import Run, render, summarize, wrong_outcomes
from pdtools.chaos_tenant_http import TENANT_FLAGS, TOKENS_PER_MINUTE
from pdtools.chaos_watch import (
    HealthProber,
    sample_node_rss,
    sample_rss,
    settle,
    steady,
    wait_ready,
)
from pdtools.disk_faults import writable_again

QUIET_S = 20.0  # steady load without faults before the checks
SETTLE_S = 30.0  # the checks may take this long to pass (nodes report every 0.2 s)
MAX_INFLIGHT, MAX_QUEUED = 32, 32  # admission limits of a server the soak starts
MAX_BODY_BYTES = 1 << 20
# a started server's engine flags, by --engine
ENGINES = {
    "defaults": [],
    "eager": ["--compile-buckets", "off"],
    "fp32-eager": ["--quantization", "none", "--compile-buckets", "off"],
}
WRITE_TIMEOUT_S = 8.0  # a started server's --stream-write-timeout-s, where it has one


def stall_for(long_s: float, write_timeout_s: float) -> float:
    """How long a stalled reader reads nothing: past the time its stream takes to be
    generated (twice the unloaded time: the server's buffers are full by then) and the
    server's write timeout after that."""
    return min(120.0, max(15.0, 2 * long_s + write_timeout_s + 10))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=30.0, help="length of the soak")
    p.add_argument("--seed", type=int, default=0, help="the fault schedule's and the load's seed")
    p.add_argument("--url", default=None, help="test this server instead of starting one")
    p.add_argument(
        "--server-pid",
        type=int,
        default=None,
        help="with --url: the pd serve process; its nodes may be signalled",
    )
    p.add_argument("--model", default=None, help="pd serve --model (default: SmolLM2)")
    p.add_argument(
        "--engine",
        choices=sorted(ENGINES),
        default="defaults",
        help="a started server's engine: pd serve's defaults, without compiled steps, or fp32 eager",
    )
    p.add_argument(
        "--speculative-tokens", type=int, default=0, help="a started server's (0: no speculation)"
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="a started server's nodes' ranks (tensor parallel); > 1 adds faults on single ranks",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="a key for requests (default: a fresh one for a server the soak starts)",
    )
    p.add_argument(
        "--admin-api-key", default=None, help="a key for /admin and /metrics (default: --api-key)"
    )
    p.add_argument("--report", type=Path, default=None, help="write the markdown report here")
    p.add_argument("--json", type=Path, default=None, help="write the summary as JSON here")
    p.add_argument(
        "--log", type=Path, default=None, help="the started server's log (default: a temp file)"
    )
    p.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=4.0,
        help="the server's (passed to one the soak starts)",
    )
    p.add_argument("--concurrency", type=int, default=4, help="steady clients")
    p.add_argument(
        "--long-tokens",
        type=int,
        default=700,
        help="tokens of a stalled reader's stream: its events must outgrow the socket buffers "
        "and the server's write buffer (~130 KB); at most the context",
    )
    p.add_argument(
        "--stall-s",
        type=float,
        default=None,
        help="a stalled reader's stall (default: from the long stream's time)",
    )
    p.add_argument(
        "--stream-write-timeout-s",
        type=float,
        default=30.0,
        help="with --url: the server's write timeout (a stall outlasts it)",
    )
    p.add_argument("--flood-clients", type=int, default=2 * (MAX_INFLIGHT + MAX_QUEUED))
    p.add_argument(
        "--max-body-bytes", type=int, default=None, help="with --url: the server's (default 8 MiB)"
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=120.0,
        help="the server's; a client waits 30 s more",
    )
    p.add_argument(
        "--max-rss-growth-mib",
        type=float,
        default=96.0,
        help="memory growth allowed: the server's, and each node's over the second half of "
        "its life",
    )
    p.add_argument(
        "--strangers-every-port",
        action="store_true",
        help="strangers connect to every port the nodes' processes listen on, not only the "
        "inbox and transfer control port they advertise",
    )
    p.add_argument(
        "--header-timeout-s",
        type=float,
        default=10.0,
        help="with --url: the server's (a silent head must be closed by then)",
    )
    p.add_argument(
        "--disk-cache-dir",
        type=Path,
        default=None,
        help="with --url: the server's disk tier (its faults are skipped without one); a "
        "server the soak starts gets a fresh one",
    )
    for flag, kind, default, text in TENANT_FLAGS:
        p.add_argument(flag, type=kind, default=default, help=text)
    p.add_argument(
        "--faults",
        nargs="+",
        choices=list(FAULTS),
        default=None,
        metavar="FAULT",
        help="run only these faults (default: every one that applies; the rank faults need "
        "--tp > 1, planted-chunk a disk tier), by lane: "
        + "; ".join(
            f"{lane}: {', '.join(names)}" for lane, names in lanes(2, True, tpm=True).items()
        ),
    )
    return p.parse_args(argv)


def free_port() -> int:
    """A free port on 127.0.0.1 for the server the soak starts, outside the kernel's ephemeral
    range (from 32768) and Ray's worker ports (10002-19999): Ray, which ``pd serve`` starts
    before it binds its HTTP port, takes ports there meanwhile."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port in 20000-32767")


def serve_args(args: argparse.Namespace, flags: set[str]) -> list[str]:
    """``pd serve`` flags of a server the soak starts; newer flags only where they exist."""
    out = [
        "--prefill", "2", "--decode", "2",
        "--heartbeat-timeout-s", f"{args.heartbeat_timeout_s:g}",
        "--max-inflight-requests", str(MAX_INFLIGHT), "--max-queued-requests", str(MAX_QUEUED),
        "--max-body-bytes", str(MAX_BODY_BYTES), "--request-timeout", f"{args.request_timeout:g}",
        "--api-key", args.api_key,
    ]  # fmt: skip
    if args.hostile_api_key:  # the hostile tenant's own key
        out += ["--api-key", args.hostile_api_key]
    if args.model:
        out += ["--model", args.model]
    if args.disk_cache_dir is not None:
        out += ["--disk-cache-dir", str(args.disk_cache_dir)]
    out += engine_args(args)
    optional = {
        "--admin-api-key": args.admin_api_key,
        "--stream-write-timeout-s": f"{WRITE_TIMEOUT_S:g}",  # a stalled reader outlasts it
        "--body-read-timeout-s": "8",  # shorter than a slow body's trickle
        "--header-timeout-s": f"{args.header_timeout_s:g}",  # the silent heads' deadline
        "--max-tokens-per-minute-per-key": str(args.tokens_per_minute or "") or None,
    }
    for flag, value in optional.items():
        if value is not None and flag in flags:
            out += [flag, value]
    return out


def engine_args(args: argparse.Namespace) -> list[str]:
    """The engine flags of a server the soak starts (none: pd serve's defaults)."""
    spec = ["--speculative-tokens", str(args.speculative_tokens)] if args.speculative_tokens else []
    tp = ["--tp", str(args.tp)] if args.tp > 1 else []
    return [*ENGINES[args.engine], *spec, *tp]


async def soak(
    args: argparse.Namespace, server: ServeProcess | None, url: str, tree: ProcessTree
) -> dict[str, Any]:
    api = Api(url, args.api_key, args.admin_api_key)
    http = httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_keepalive_connections=0))
    try:
        return await _soak(args, server, api, http, tree)
    finally:
        await http.aclose()
        await api.close()


async def _soak(
    args: argparse.Namespace,
    server: ServeProcess | None,
    api: Api,
    http: httpx.AsyncClient,
    tree: ProcessTree,
) -> dict[str, Any]:
    pools = await wait_ready(api, server)
    sizes = dict(pools.target)
    disk_writer = 1 if args.disk_cache_dir is not None else 0  # started on a node's first write
    idle_threads = {
        r: max((n["threads"] for n in pools.of(r) if n["pair_groups"] == 0), default=0)
        + disk_writer
        for r in ROLES
    }
    model = (await http.get("/v1/models", headers=api.headers())).json()["data"][0]
    long = long_spec(min(args.long_tokens, model["max_model_len"] - 16))
    deadline_s = args.request_timeout + 30
    print(f"computing reference answers on the unloaded server ({api.url}) ...", flush=True)
    refs = await references(http, make_specs(), [long], api.headers())
    if refs.problems:
        raise RuntimeError("no stable reference answers: " + "; ".join(refs.problems))
    metrics0 = await api.metrics()
    settings = Settings(
        url=api.url, sizes=sizes, heartbeat_s=args.heartbeat_timeout_s, deadline_s=deadline_s,
        max_body_bytes=args.max_body_bytes or (MAX_BODY_BYTES if server else 8 << 20),
        max_model_len=model["max_model_len"], admin_roles=bool(args.admin_api_key and args.admin_api_key != args.api_key),
        flood_clients=args.flood_clients, flood_s=6.0, num_stalled=6,
        stall_s=args.stall_s or stall_for(refs.seconds[long.name], args.stream_write_timeout_s),
        num_slow=MAX_INFLIGHT + 8, slow_s=15.0, junk_frames=20_000, junk_big_bytes=8 << 20,
        header_timeout_s=args.header_timeout_s, disk_dir=args.disk_cache_dir,
        strangers_every_port=args.strangers_every_port,
        hostile_key=args.hostile_api_key or args.api_key, tokens_per_minute=args.tokens_per_minute or 0,
        hostile_tokens=args.hostile_tokens, hostile_rss_mib=args.max_rss_growth_mib,
    )  # fmt: skip
    outcomes: list[Outcome] = []
    monitor = Monitor(api)
    chaos = Chaos(api, monitor, tree, settings, refs, long, outcomes)
    rss: list[tuple[float, float]] = []
    node_rss: dict[str, list[tuple[float, float]]] = {}
    origin = time.monotonic()
    end = origin + 60 * args.minutes
    faults_end, load_end = end - SETTLE_S - QUIET_S, end - SETTLE_S
    print(
        f"soak: {args.minutes:g} min, seed {args.seed}, {len(refs.specs)} requests with known answers, faults until t={faults_end - origin:.0f} s",
        flush=True,
    )
    monitor.start()
    sampler = asyncio.get_running_loop().create_task(
        sample_rss(server.pid if server else args.server_pid, rss)
    )
    node_sampler = asyncio.get_running_loop().create_task(sample_node_rss(monitor, tree, node_rss))
    prober = HealthProber(api.url)
    has_tpm = bool(args.tokens_per_minute)
    faults = lanes(args.tp, args.disk_cache_dir is not None, args.faults, tpm=has_tpm)
    await asyncio.gather(
        *(
            chaos.lane(names, faults_end, random.Random(f"{args.seed}/{lane}"))
            for lane, names in faults.items()
        ),
        *(
            steady(http, api, refs, 1000 * args.seed + i, load_end, deadline_s, outcomes)
            for i in range(args.concurrency)
        ),
    )
    checks, _ = await settle(api, sizes, idle_threads, max(SETTLE_S, end - time.monotonic()))
    metrics1 = await api.metrics()
    await monitor.poll()
    await monitor.stop()
    for task in (sampler, node_sampler):
        task.cancel()
    health = [(when - origin, took) for when, took in prober.stop()]
    engine = (" ".join(engine_args(args)) or "defaults") if server is not None else ""
    run = Run(
        args.minutes, args.seed, model["id"], sizes, chaos, monitor, refs, outcomes, checks,
        metrics0, metrics1, rss, origin, args.max_rss_growth_mib, engine, node_rss=node_rss,
        health=health, max_health_p99_ms=args.max_health_p99_ms,
    )  # fmt: skip
    wrong = [out.request_id for out in wrong_outcomes(run)[:20] if out.request_id]
    routes = {rid: await api.routes(rid) for rid in wrong}
    return summarize(run._replace(routes=routes))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server: ServeProcess | None = None
    if args.url is None:
        args.api_key = args.api_key or secrets.token_hex(16)
        log = args.log or Path(tempfile.mkdtemp(prefix="chaos-soak-")) / "serve.log"
        flags = serve_flags()
        if "--admin-api-key" not in flags:  # this server has one kind of key
            args.admin_api_key = None
        else:  # a tenant key for the load, an admin key for /admin and /metrics
            args.admin_api_key = args.admin_api_key or secrets.token_hex(16)
        args.stream_write_timeout_s = (
            WRITE_TIMEOUT_S if "--stream-write-timeout-s" in flags else 0.0
        )
        args.hostile_api_key = args.hostile_api_key or secrets.token_hex(16)
        if "--max-tokens-per-minute-per-key" not in flags:
            args.tokens_per_minute = 0
        elif args.tokens_per_minute is None:
            args.tokens_per_minute = TOKENS_PER_MINUTE
        if "--disk-cache-dir" in flags:  # a disk tier the soak owns (harmed by its faults)
            args.disk_cache_dir = Path(tempfile.mkdtemp(prefix="chaos-soak-disk-"))
        server = ServeProcess(serve_args(args, flags), free_port(), log)
        print(f"started pd serve (pid {server.pid}, log {log})", flush=True)
    url = server.url if server else args.url.rstrip("/")
    tree = ProcessTree(server.pid if server else args.server_pid)
    try:
        summary = asyncio.run(soak(args, server, url, tree))
    except RuntimeError as e:
        print(f"chaos_soak: cannot run: {e}", file=sys.stderr)
        return 2
    except Exception:  # a bug of the soak's own: no verdict on the server
        traceback.print_exc()
        print("chaos_soak: the soak itself failed (above)", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            code = server.end()
            print(f"pd serve ended (exit status {code})", flush=True)
            if args.disk_cache_dir is not None:  # the soak's own: made writable, removed
                writable_again(args.disk_cache_dir)
                shutil.rmtree(args.disk_cache_dir, ignore_errors=True)
    report = render(summary)
    print(report)
    if args.report:
        args.report.write_text(report)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
