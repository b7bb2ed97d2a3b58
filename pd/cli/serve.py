"""``pd serve``: start the cluster, then the OpenAI-compatible HTTP server in this process.

On SIGTERM it shuts down gracefully (``_GracefulServer``): new requests get 503, those in flight
have ``shutdown_grace_s`` to finish, then the server exits and stops its nodes (detached nodes,
``--address`` with ``--keep-nodes``, stay for the next server to attach). A second SIGTERM, or
SIGINT, exits at once (uvicorn's own shutdown).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from pd.cli.flags import AUTOSCALE_PREFIX, dataclass_from_args
from pd.cluster.client_config import ClientConfig
from pd.executor.config import EngineConfig
from pd.fleet.admin import ClusterAdmin
from pd.fleet.autoscaler import Autoscaler, AutoscalerConfig
from pd.fleet.config import ClusterConfig
from pd.fleet.launcher import Cluster
from pd.model.tokenizer import load_tokenizer
from pd.router.policy import CoordinatorConfig
from pd.server.app import build_app
from pd.server.config import ServerConfig
from pd.server.http.listener import Listener, max_connections_for, raise_fd_limit
from pd.server.metrics import ServerMetrics
from pd.server.state import ServerState
from transfer.endpoint import is_loopback
from transfer.state import TransferConfig

logger = logging.getLogger(__name__)
_EXIT_RESERVE_S = 5.0  # at most, of the shutdown grace period: for closing and stopping


def build_cluster_app(
    cluster: Cluster,
    model_name: str,
    server_cfg: ServerConfig | None = None,
    autoscaler: AutoscalerConfig | None = None,
) -> FastAPI:
    """The HTTP app over a started cluster, with the admin endpoints (and, when
    ``autoscaler.enabled``, the autoscaler running on the server's event loop)."""
    runner_dir = cluster.engine_cfg.model
    tokenizer = load_tokenizer(runner_dir)
    info = next(iter(cluster.client.membership.nodes.values()))
    client = cluster.client
    metrics = ServerMetrics()
    admin = ClusterAdmin(cluster)
    app = build_app(
        client,
        tokenizer=tokenizer,
        model_name=model_name,
        max_model_len=info.max_model_len,
        config=server_cfg,
        metrics=metrics,
        stats_fn=client.stats,
        extra_health=lambda: {"nodes": sorted(client.membership.nodes)},
        admin=admin,
    )

    async def on_startup() -> None:
        await client.start()  # read the nodes (attached ones send their snapshots) at once
        if autoscaler is not None and autoscaler.enabled:
            admin.start_autoscaler(Autoscaler(autoscaler, cluster, metrics.registry))

    async def on_shutdown() -> None:
        # closed here, on its loop: a client left to the garbage collector takes its zmq
        # context along, and terminating a context whose sockets were never closed blocks
        await client.close()

    app.router.on_startup.append(on_startup)
    app.router.on_shutdown.append(on_shutdown)
    return app


def _announce_when_healthy(url: str, stop: threading.Event) -> None:
    context = None
    if url.startswith("https"):  # our own server, perhaps self-signed: only its answer counts
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    while not stop.is_set():
        try:  # /ready: every pool has a live node (/health answers as soon as HTTP does)
            with urllib.request.urlopen(f"{url}/ready", timeout=2, context=context) as resp:
                if resp.status == 200:
                    print(f"pd is serving {url}/v1 (OpenAI-compatible)", flush=True)
                    return
        except OSError:
            pass
        time.sleep(0.2)


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, but the first SIGTERM drains: the app stops admitting (503) and its
    requests in flight get ``grace_s`` to finish (``ServerState.shut_down``); then uvicorn's
    shutdown runs as usual and ``run()`` returns (no signal is re-raised: the exit is clean)."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float) -> None:
        super().__init__(config)
        self._state = state
        self._grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[Any] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self._drain is not None or self._loop is None:
            super().handle_exit(sig, frame)  # a second signal, or one before start-up
            return
        # a signal handler runs between two bytecodes of the loop's thread: hand over
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        start = time.monotonic()
        # the end of the grace period is kept for closing connections and stopping the engine
        # or the nodes, so that the process is gone within it
        drain_s = self._grace_s - min(_EXIT_RESERVE_S, self._grace_s / 5)
        logger.warning("SIGTERM: not admitting; %.1f s for the requests in flight", drain_s)
        if not await self._state.shut_down(drain_s):
            logger.warning("requests still in flight after %.1f s: cut off", drain_s)
        # what is left: answers being written (cut ones end at once)
        left_s = self._grace_s - (time.monotonic() - start)
        self.config.timeout_graceful_shutdown = max(left_s / 2, 0.5)
        self.should_exit = True


def serve(args: argparse.Namespace, engine_cfg: EngineConfig, server_cfg: ServerConfig) -> int:
    if not is_loopback(args.host) and not (server_cfg.api_key or server_cfg.admin_api_key):
        logger.warning(
            "--host %s is not a loopback address and no API key is set: whoever reaches port "
            "%d may use the API, admin routes included; set --api-key-file, "
            "--admin-api-key-file or PD_API_KEY",
            args.host,
            args.port,
        )
    if args.colocated:
        return _serve_colocated(args, engine_cfg, server_cfg)

    # the cluster waits (for room, for a replacement node) no longer than the server lets a
    # request live
    client_cfg = dataclasses.replace(
        dataclass_from_args(ClientConfig, args), request_timeout_s=server_cfg.request_timeout
    )
    num_prefill = prefill_pool_size(args)
    cluster_cfg = dataclass_from_args(
        ClusterConfig,
        args,
        num_prefill=num_prefill,
        host=args.host,
        client=client_cfg,
        transfer=dataclass_from_args(TransferConfig, args, prefix="transfer_"),
    )
    autoscaler = dataclass_from_args(AutoscalerConfig, args, prefix=AUTOSCALE_PREFIX)
    cluster = Cluster(engine_cfg, cluster_cfg, dataclass_from_args(CoordinatorConfig, args))
    num_decode = cluster_cfg.num_decode
    if num_prefill:
        print(f"starting {num_prefill} prefill + {num_decode} decode nodes ...", flush=True)
    else:
        print(
            f"starting {num_decode} decode node(s), which prefill too (no prefill pool; "
            "--prefill N or `pd scale --prefill N` adds one) ...",
            flush=True,
        )
    if engine_cfg.buckets and cluster_cfg.address is None:
        sizes = ",".join(map(str, engine_cfg.buckets))
        print(
            f"(decode nodes compile their decode steps for batches of {sizes} first: minutes on "
            "a CPU; --compile-buckets off skips it)",
            flush=True,
        )
    cluster.start()
    if cluster.attached:
        print(f"attached to running nodes: {', '.join(cluster.attached)}", flush=True)
    model_name = args.served_model_name or _default_name(cluster.engine_cfg)
    app = build_cluster_app(cluster, model_name, server_cfg, autoscaler)
    return _run_http(app, args, on_exit=cluster.shutdown)


def prefill_pool_size(args: argparse.Namespace) -> int:
    """``--prefill``, or by default: 0 for a cluster on this machine's CPUs (no ``--address``,
    no ``--node-gpus``), whose nodes would all share its cores: there a prefill node only
    slows the decode node's steps down and is slowed by them (docs/bench/history.md, "No
    prefill pool on one CPU machine"); else 1,
    the smallest disaggregated cluster, and 1 with ``--autoscale`` (whose prefill pool starts
    at its minimum)."""
    if args.num_prefill is not None:
        return int(args.num_prefill)
    on_this_cpu = args.address is None and not args.node_gpus
    return 0 if on_this_cpu and not args.autoscale_enabled else 1


def _run_http(app: FastAPI, args: argparse.Namespace, on_exit: Callable[[], None]) -> int:
    state: ServerState = app.state.server
    cfg = state.config
    scheme = "https" if cfg.ssl_certfile else "http"
    url = f"{scheme}://{args.host}:{args.port}"
    max_connections = max_connections_for(cfg.max_connections, raise_fd_limit())
    ssl_context = None
    if cfg.ssl_certfile:  # TLS inside the listener's guard, not under uvicorn: see there
        ssl_context = uvicorn.config.create_ssl_context(
            cfg.ssl_certfile,
            cfg.ssl_keyfile,
            None,
            uvicorn.config.SSL_PROTOCOL_VERSION,
            ssl.CERT_NONE,
            None,
            "TLSv1",  # uvicorn's default ciphers
        )
    listener = Listener(max_connections, cfg.header_timeout_s, state.metrics, ssl_context)
    logger.info(
        "HTTP: at most %d connections, each request's head within %g s, %d MiB of bodies "
        "being received",
        max_connections,
        cfg.header_timeout_s,
        cfg.max_body_bytes_in_flight >> 20,
    )
    stop = threading.Event()
    threading.Thread(target=_announce_when_healthy, args=(url, stop), daemon=True).start()
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        http=listener.protocol,  # type: ignore[arg-type]  # a factory of protocols
        ws="none",  # no websocket routes: an upgrade would leave the listener's count
        log_level="warning",
    )
    try:
        _GracefulServer(config, state, cfg.shutdown_grace_s).run()
    finally:
        stop.set()
        on_exit()
    return 0


def _default_name(engine_cfg: EngineConfig) -> str:
    from pd.model.loader import resolve_model

    return resolve_model(engine_cfg.model).name


def _serve_colocated(
    args: argparse.Namespace, engine_cfg: EngineConfig, server_cfg: ServerConfig
) -> int:
    """One process, no Ray: the colocated engine behind the same HTTP API (the baseline)."""
    from pd.core.outputs import ClusterStats
    from pd.engine.async_engine import AsyncEngine
    from pd.engine.engine import Engine

    client = AsyncEngine(lambda: Engine(engine_cfg))  # built on its own thread: see there
    engine = client.engine
    app = build_app(
        client,
        tokenizer=engine.tokenizer,
        model_name=args.served_model_name or _default_name(engine_cfg),
        max_model_len=engine.max_model_len,
        config=server_cfg,
        stats_fn=lambda: ClusterStats([client.stats()]),
    )
    return _run_http(app, args, on_exit=client.shutdown)
