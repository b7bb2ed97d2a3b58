"""``ray_cluster.onprem.yaml`` passes Ray's own checks, its shell commands give each machine
its own address and its role's resources, and the harness's edits (``pdtools/netns_ray.py``)
touch only what a person edits. No Ray cluster, no root: tests/multihost/ runs it for real."""

from __future__ import annotations

import copy
import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdtools import netns_ray
from pdtools.netns_ray import EXAMPLE_CHECKOUT, EXAMPLE_HEAD, PD_SERVE, render_onprem
from tests.fleet.test_ray_cluster_yaml import documented_serve_command

_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)
YAML = _ROOT / "ray_cluster.onprem.yaml"
WORKERS = {"10.77.0.12": {"prefill": 1}, "10.77.0.13": {"decode": 1}, "10.77.0.14": {"prefill": 2}}


def _render() -> str:
    return render_onprem("10.77.0.11", WORKERS, "/work/pd", "root", "/keys/id")


def _prepared(text: str) -> dict[str, Any]:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(copy.deepcopy(yaml.safe_load(text)))  # as `ray up` does
    validate_config(config)
    return config


def _run_worker_start(text: str, source_ip: str) -> list[str]:
    """The worker's `ray start` line as bash runs it, with `ip` and `ray` stubbed: what the
    machine whose route to the head leaves from ``source_ip`` would start Ray with."""
    command = yaml.safe_load(text)["worker_start_ray_commands"][1]
    route = f"10.77.0.11 dev eth0 src {source_ip} uid 0 \\    cache"
    stubs = (
        f"ip() {{ echo '{route}'; }}; ray() {{ printf '%s\\n' \"$@\"; }}; RAY_HEAD_IP=10.77.0.11; "
    )
    out = subprocess.run(
        ["bash", "-c", stubs + command], capture_output=True, text=True, timeout=10
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()


def test_the_yaml_passes_rays_validation_as_a_local_cluster() -> None:
    config = _prepared(YAML.read_text())
    assert config["provider"]["type"] == "local"
    # the local provider has one node type; every listed worker joins
    (node_type,) = config["available_node_types"].values()
    assert node_type["min_workers"] == node_type["max_workers"] == 2
    _prepared(_render())


def test_each_machine_starts_ray_on_its_own_address_with_its_roles_resources() -> None:
    text = _render()
    config = yaml.safe_load(text)
    head = " ".join(config["head_start_ray_commands"])
    assert "--node-ip-address=10.77.0.11" in head and "RAY_enable_autoscaler_v2=0" in head
    for ip, resources in WORKERS.items():
        args = _run_worker_start(text, ip)
        assert args[:2] == ["start", "--address=10.77.0.11:6379"], args
        assert f"--node-ip-address={ip}" in args
        assert json.loads(args[-1].removeprefix("--resources=")) == resources
    assert _run_worker_start(text, "10.77.0.99")[-1] == "--resources={}"


def test_every_command_ray_runs_finds_the_venv_and_workers_follow_the_head_down() -> None:
    config = yaml.safe_load(_render())
    (setup,) = config["setup_commands"]  # before any start command, on every machine
    assert "export PATH=/work/pd/.venv/bin:$PATH" in setup and "~/.bashrc" in setup
    *starts, monitor = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    for command in starts:  # a bare `ray`: the venv's, from PATH
        assert re.search(r"(^|; )(RAY_\w+=\S+ )*ray (stop|start)", command), command
    assert "python /work/pd/scripts/ray_head_monitor.py $RAY_HEAD_IP:6379" in monitor
    assert monitor.rstrip().endswith("&")  # in the background: `ray up` goes on


def test_rendering_changes_only_what_a_person_edits() -> None:
    template, rendered = YAML.read_text(), _render()
    table = "".join(f"      {ip}) resources='{json.dumps(r)}' ;;\n" for ip, r in WORKERS.items())
    expected = re.sub(r"( +10\.0\.0\.\d+\) resources='.*' ;;\n)+", lambda m: table, template)
    expected = expected.replace("[10.0.0.11, 10.0.0.12]", f"[{', '.join(WORKERS)}]")
    expected = expected.replace(EXAMPLE_HEAD, "10.77.0.11").replace(EXAMPLE_CHECKOUT, "/work/pd")
    expected = expected.replace("ssh_private_key: ~/.ssh/id_ed25519", "ssh_private_key: /keys/id")
    assert rendered == expected
    with pytest.raises(ValueError, match="no .* to edit"):
        render_onprem("10.77.0.11", WORKERS, "/work/pd", "root", "/k", template="cluster_name: x\n")


def test_the_documented_serve_command_is_the_harness_one_and_asks_for_the_table_s_roles() -> None:
    from pd.cli import build_parser

    serve = documented_serve_command(YAML)
    assert " ".join(serve.split()) == PD_SERVE
    readme = (_ROOT / "README.md").read_text()
    assert f"ray exec ray_cluster.onprem.yaml '{PD_SERVE}'" in readme
    args = build_parser().parse_args(shlex.split(PD_SERVE)[1:])
    assert args.address == "auto" and args.host == "0.0.0.0" and args.port == netns_ray.PORT
    roles = [r for r in re.findall(r"resources='(\{.+?\})'", YAML.read_text())]
    assert [json.loads(r) for r in roles] == [args.prefill_resources, args.decode_resources]
