"""``ray_cluster.yaml`` passes Ray's own config checks as ``ray up`` runs them, and its worker
types carry the custom resources the README's ``pd serve`` pins each role to."""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.timeout(60)
YAML = Path(__file__).resolve().parents[2] / "ray_cluster.yaml"


def documented_serve_command(yaml_path: Path) -> str:
    """The `pd serve ...` command quoted in a ray cluster yaml's header comment (its
    backslash-continued lines joined)."""
    header = yaml_path.read_text().split("\ncluster_name:")[0]
    lines = [line.lstrip("# ").rstrip() for line in header.splitlines()]
    start = next(i for i, line in enumerate(lines) if "'pd serve" in line)
    command = ""
    for line in lines[start:]:
        command += line.rstrip("\\")
        if not line.endswith("\\"):
            break
    serve = re.search(r"'(pd serve .*)'", command)
    assert serve is not None, command
    return serve.group(1)


def _load() -> dict[str, Any]:
    return yaml.safe_load(YAML.read_text())


def test_ray_cluster_yaml_passes_rays_validation() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(copy.deepcopy(_load()))  # fills the defaults `ray up` fills
    validate_config(config)  # raises on a schema error
    types = config["available_node_types"]
    assert config["head_node_type"] == "head" and types["head"]["max_workers"] == 0
    assert sum(t["max_workers"] for n, t in types.items() if n != "head") <= config["max_workers"]


def test_each_role_has_a_worker_type_with_its_resource_and_none_lands_on_the_head() -> None:
    types = _load()["available_node_types"]
    by_resource = {name: t["resources"] for name, t in types.items() if t.get("resources")}
    assert by_resource == {
        "prefill_worker": {"prefill": 1},
        "decode_worker": {"decode": 1},
        # the 8-GPU machine of tensor-parallel nodes: one TP-4 prefill, two TP-2 decode nodes
        "tp8_worker": {"prefill": 1, "decode": 2},
    }
    assert types["head"]["resources"] == {}
    for name in ("prefill_worker", "decode_worker"):
        assert types[name]["min_workers"] >= 1, name  # the first node of each pool has a home


def test_the_documented_serve_command_pins_each_role_to_its_worker_type() -> None:
    """The `pd serve` line in the yaml's header parses with pd's own CLI and asks, per role, for
    exactly the resource its worker type offers."""
    from pd.cli import build_parser

    serve = documented_serve_command(YAML)
    args = build_parser().parse_args(shlex.split(serve)[1:])
    assert args.address == "auto" and args.node_gpus == 1 and args.host == "0.0.0.0"
    types = _load()["available_node_types"]
    assert args.prefill_resources == types["prefill_worker"]["resources"]
    assert args.decode_resources == types["decode_worker"]["resources"]
    assert json.dumps(args.prefill_resources) == '{"prefill": 1.0}'
