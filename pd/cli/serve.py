"""``pd serve``: start the cluster, then the OpenAI-compatible HTTP server in this process."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import threading
import time
import urllib.request
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI

from pd.cluster.admin import ClusterAdmin
from pd.cluster.autoscaler import Autoscaler, AutoscalerConfig
from pd.cluster.client import ClientConfig
from pd.cluster.coordinator import CoordinatorConfig
from pd.cluster.launcher import Cluster, ClusterConfig
from pd.engine.config import EngineConfig
from pd.model.tokenizer import load_tokenizer
from pd.server.app import build_app
from pd.server.config import ServerConfig
from pd.server.metrics import ServerMetrics
from transfer import TransferConfig

logger = logging.getLogger(__name__)


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
    info = next(iter(cluster.client.nodes.values()))
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
        extra_health=lambda: {"nodes": sorted(client.nodes)},
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
    while not stop.is_set():
        try:  # /ready: every pool has a live node (/health answers as soon as HTTP does)
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as resp:
                if resp.status == 200:
                    print(f"pd is serving {url}/v1 (OpenAI-compatible)", flush=True)
                    return
        except OSError:
            pass
        time.sleep(0.2)


def serve(args: argparse.Namespace, engine_cfg: EngineConfig, server_cfg: ServerConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.colocated:
        return _serve_colocated(args, engine_cfg, server_cfg)
    from pd.cli import AUTOSCALE_PREFIX, dataclass_from_args

    # the cluster waits (for room, for a replacement node) no longer than the server lets a
    # request live
    client_cfg = dataclasses.replace(
        dataclass_from_args(ClientConfig, args), request_timeout_s=server_cfg.request_timeout
    )
    cluster_cfg = ClusterConfig(
        num_prefill=args.prefill,
        num_decode=args.decode,
        address=args.address,
        host=args.host,
        node_gpus=args.node_gpus,
        namespace=args.namespace,
        keep_nodes=args.keep_nodes,
        prefill_resources=args.prefill_resources,
        decode_resources=args.decode_resources,
        client=client_cfg,
        transfer=dataclass_from_args(TransferConfig, args, prefix="transfer_"),
    )
    autoscaler = dataclass_from_args(AutoscalerConfig, args, prefix=AUTOSCALE_PREFIX)
    cluster = Cluster(
        engine_cfg,
        cluster_cfg,
        CoordinatorConfig(
            policy=args.policy,
            local_prefill_tokens=args.local_prefill_tokens,
            local_prefill_min_held=args.local_prefill_min_held,
            local_prefill_balance=args.local_prefill_balance,
        ),
    )
    print(f"starting {args.prefill} prefill + {args.decode} decode nodes ...", flush=True)
    cluster.start()
    if cluster.attached:
        print(f"attached to running nodes: {', '.join(cluster.attached)}", flush=True)
    model_name = args.served_model_name or _default_name(cluster.engine_cfg)
    app = build_cluster_app(cluster, model_name, server_cfg, autoscaler)
    return _run_http(app, args, on_exit=cluster.shutdown)


def _run_http(app: FastAPI, args: argparse.Namespace, on_exit: Callable[[], None]) -> int:
    url = f"http://{args.host}:{args.port}"
    stop = threading.Event()
    threading.Thread(target=_announce_when_healthy, args=(url, stop), daemon=True).start()
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
    try:
        uvicorn.Server(config).run()
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
