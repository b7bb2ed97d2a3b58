"""A live cluster behind a real HTTP server, for end-to-end tests.

Ray starts once per test session (``ray_session``, in ``tests/conftest.py``: the fleet's tests
share it); each cluster (1P+1D, 2P+1D, ...) lives for one module or one parametrization, and
after every test each node's slot pool must be back to idle.

``ServeProcess`` is the other way in: a ``pd serve`` process, as users start it.

A module gets its cluster as the ``live`` fixture by defining ``live_spec`` (module scope: the
``start_live_cluster`` arguments; parametrize it for one cluster per parameter), and has every
test end with the pool check by ``pytest.mark.usefixtures("pools_whole_after_each_test")``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from tests.conftest import free_port


class LiveCluster(NamedTuple):
    url: str  # http://127.0.0.1:PORT
    cluster: object  # pd.fleet.launcher.Cluster


@pytest.fixture(scope="module")
def live(live_spec: dict[str, Any], ray_session: None) -> Iterator[LiveCluster]:
    """The module's cluster, started as its ``live_spec`` fixture says."""
    live, stop = start_live_cluster(**live_spec)
    yield live
    stop()


@pytest.fixture
def pools_whole_after_each_test(live: LiveCluster) -> Iterator[None]:
    yield
    wait_idle_and_check(live)


def start_live_cluster(
    num_prefill: int,
    num_decode: int,
    policy: str = "cache_aware",
    page_size: int = 1,
    model: str | None = None,
    local_prefill_tokens: int = -1,
    server_cfg: object = None,
    engine_kwargs: dict[str, object] | None = None,
    **cluster_kwargs: object,
) -> tuple[LiveCluster, object]:
    """``model``: a model dir (default SmolLM2); ``server_cfg``: the HTTP server's
    ServerConfig (keys, limits); ``engine_kwargs`` go to EngineConfig, ``cluster_kwargs`` to
    ClusterConfig. Conditional
    disaggregation is off unless ``local_prefill_tokens`` says otherwise: these tests are about
    the transfer path (its own tests turn it on). Returns once GET /ready answers 200."""
    import uvicorn

    from pd.cli.serve import build_cluster_app
    from pd.executor.config import EngineConfig
    from pd.fleet.config import ClusterConfig
    from pd.fleet.launcher import Cluster
    from pd.router.policy import CoordinatorConfig

    engine_kw: dict[str, object] = {"max_total_tokens": 8192, "max_running_requests": 48}
    engine_kw.update(engine_kwargs or {})
    engine_cfg = EngineConfig(model=model, page_size=page_size, **engine_kw)  # type: ignore[arg-type]
    cluster = Cluster(
        engine_cfg,
        ClusterConfig(
            num_prefill=num_prefill,
            num_decode=num_decode,
            threads_per_node=1,
            **cluster_kwargs,  # type: ignore[arg-type]
        ),
        CoordinatorConfig(policy=policy, local_prefill_tokens=local_prefill_tokens),
    )
    cluster.start()

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)
        cluster.shutdown()

    app = build_cluster_app(cluster, "SmolLM2-135M-Instruct", server_cfg)  # type: ignore[arg-type]
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 180  # node start-up on a loaded 2-core machine took > 60 s once
    import httpx

    while time.monotonic() < deadline and thread.is_alive():  # uvicorn ends if start-up fails
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    else:
        stop()  # its nodes would go on running beside the tests that follow
        raise TimeoutError("cluster did not become ready in 180 s (or its server exited)")

    return LiveCluster(f"http://127.0.0.1:{port}", cluster), stop


def wait_idle_and_check(live: LiveCluster, timeout_s: float = 20.0) -> dict[str, dict[str, int]]:
    """Wait until no node holds a request, then assert every pool is whole and idle."""
    cluster = live.cluster
    deadline = time.monotonic() + timeout_s
    while True:
        report = cluster.check_integrity()
        if all(r["unfinished"] == 0 for r in report.values()):
            break
        assert time.monotonic() < deadline, (
            f"requests still in flight after {timeout_s} s: {report}"
        )
        time.sleep(0.1)
    for node_id, r in report.items():
        assert r["in_use"] == 0, f"{node_id} leaked slots: {r}"
        assert r["free"] + r["cached"] + r["in_use"] == r["total"], (node_id, r)
    return report


def end_process_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the process group ``proc`` leads, if it still runs, and reap it;
    SIGKILL if it has not exited within 60 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# fp32 weights and eager steps (the engine's defaults), not pd serve's int4 and compiled steps:
# answers equal to HF's, and a start in seconds instead of minutes
EXACT_EAGER = ["--quantization", "none", "--compile-buckets", "off"]


class ServeProcess:
    """One ``pd serve --port PORT *args`` process in a process group of its own, its output in
    ``log``. Made once it prints its URL; fails (and ends it) if it exits or ``timeout_s``
    passes first. ``env`` None: this process's environment. ``scheme``: https when ``args``
    give it a certificate. ``EXACT_EAGER`` comes before ``args`` unless ``serve_defaults``."""

    def __init__(
        self,
        args: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        timeout_s: float = 180.0,
        scheme: str = "http",
        serve_defaults: bool = False,
    ) -> None:
        self.port = free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.log = log
        engine = [] if serve_defaults else EXACT_EAGER
        cmd = [sys.executable, "-m", "pd.cli", "serve", "--port", str(self.port), *engine, *args]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            deadline = time.monotonic() + timeout_s
            while f"pd is serving {self.url}/v1" not in log.read_text():
                assert self.proc.poll() is None, f"pd serve exited: {self.tail()}"
                assert time.monotonic() < deadline, (
                    f"no URL printed in {timeout_s} s: {self.tail()}"
                )
                time.sleep(0.3)
        except BaseException:
            self.end()
            raise

    def tail(self) -> str:
        return self.log.read_text()[-4000:]

    def end(self, sig: int = signal.SIGKILL) -> None:
        end_process_group(self.proc, sig)


def serve_colocated(
    model_dir: Path,
    log: Path,
    *args: str,
    scheme: str = "http",
    env: dict[str, str] | None = None,
) -> ServeProcess:
    """``pd serve --colocated`` on ``model_dir`` (a tiny model): a real server process without
    Ray, quick to start."""
    return ServeProcess([*colocated_args(model_dir), *args], log, env, timeout_s=120, scheme=scheme)


def colocated_args(model_dir: Path) -> list[str]:
    """``serve_colocated``'s flags before its ``args``."""
    return [
        "--colocated", "--model", str(model_dir), "--max-total-tokens", "4096",
        "--num-threads", "1",  # 2 shared cores: more threads only contend
        "--compile-buckets", "off",  # seconds to start: these tests are about the server
    ]  # fmt: skip
