"""Start-up that cannot be derailed: without ``--address``, ``pd serve`` starts a private Ray
instance whatever other Ray cluster the machine has (live, or killed with its record left
behind); with ``--address``, an unreachable cluster is a clear error within seconds.

The other cluster is started the way users do (``ray start --head``), in a temp dir of its own
(RAY_TMPDIR), so the record it leaves cannot disturb anyone else's Ray on this machine; every
process started here is ended through its own process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.cluster.conftest import ServeProcess, end_process_group
from tests.conftest import free_port

pytestmark = pytest.mark.timeout(300)
RAY = str(Path(sys.executable).parent / "ray")


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    # short: Ray's unix socket paths live under it
    with tempfile.TemporaryDirectory(prefix="pdr-", dir="/tmp") as d:
        yield Path(d)


def _env(ray_tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    root = str(Path(__file__).resolve().parents[2])
    return {**env, "RAY_TMPDIR": str(ray_tmp), "PYTHONPATH": root, **extra}


def test_pd_serve_starts_beside_a_live_ray_cluster_and_after_a_killed_one(
    tiny_llama_dir, ray_tmp, tmp_path
) -> None:
    env = _env(ray_tmp)
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--port", str(free_port()), "--num-cpus", "1"]
        + ["--include-dashboard=false"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    record = ray_tmp / "ray" / "ray_current_cluster"
    try:
        deadline = time.monotonic() + 120
        while not record.exists():
            assert head.poll() is None and time.monotonic() < deadline, "ray start failed"
            time.sleep(0.3)
        other = record.read_text().strip()
        # 1. it runs, and ray.init() would join it (and refuse pd's resources): pd's own
        # start-up gets a private instance, even with RAY_ADDRESS naming the other one
        code = (
            "import ray; from pd.fleet.config import ClusterConfig, init_ray; "
            "init_ray(ClusterConfig()); print('GCS', ray.get_runtime_context().gcs_address)"
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**env, "RAY_ADDRESS": other},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        gcs = next(line for line in out.stdout.splitlines() if line.startswith("GCS")).split()[1]
        assert gcs != other
    finally:
        end_process_group(head)  # killed: its record stays behind, naming a dead cluster
    assert record.read_text().strip() == other

    # 2. `pd serve` starts and serves all the same
    model = ["--model", str(tiny_llama_dir)]
    args = [*model, "--max-total-tokens", "2048", "--compile-buckets", "off"]  # quick to start
    server = ServeProcess(args, tmp_path / "serve.log", env)
    try:
        body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 4}}
        r = httpx.post(f"{server.url}/generate", json=body, timeout=60)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, r.text
    finally:
        server.end(signal.SIGINT)

    # 3. naming the dead cluster is a clear error, within seconds (ray.init would retry for
    # minutes)
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "pd.cli", "serve", "--address", other, *model],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - start
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    assert f"pd: error: cannot reach the Ray cluster at {other}" in out.stderr, out.stderr[-3000:]
    assert took < 30, took  # imports included; the connection check itself takes 5 s at most


def test_address_auto_reaches_ray_as_auto_so_it_finds_the_auth_token(monkeypatch) -> None:
    """Ray reads ~/.ray/auth_token only for ``ray.init("auto")``, never for an explicit
    address: `pd serve --address auto` on a token-auth cluster (ray_cluster.onprem.yaml)
    was refused ("Authentication token is missing") when pd resolved "auto" itself."""
    import ray

    from pd.fleet import config

    calls: list[str] = []
    monkeypatch.setattr(config, "reachable_address", lambda address, timeout_s: "10.0.0.10:6379")
    monkeypatch.setattr(ray, "init", lambda address, namespace: calls.append(address))
    config.init_ray(config.ClusterConfig(address="auto"))
    config.init_ray(config.ClusterConfig(address="10.0.0.10:6379"))
    assert calls == ["auto", "10.0.0.10:6379"]


def test_the_servers_port_is_picked_where_other_processes_ports_never_land(monkeypatch) -> None:
    """The server binds its PULL port only after its nodes started, which bind hundreds of
    ephemeral ports meanwhile: the port is picked below that range, above Ray's workers'."""
    import random
    import socket

    from pd.fleet import config

    low, _ = config._ephemeral_ports()
    assert low > 20000  # this machine's kernel: 32768
    ports = {config.free_port("127.0.0.1") for _ in range(20)}
    assert all(20000 <= p < low for p in ports), ports
    first = config.free_port("127.0.0.1", random.Random(5))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", first))
        assert config.free_port("127.0.0.1", random.Random(5)) != first  # the next pick
    monkeypatch.setattr(config, "_ephemeral_ports", lambda: (20000, 60999))  # no room below
    assert config.free_port("127.0.0.1") >= low  # the kernel's pick
