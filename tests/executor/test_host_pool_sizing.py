"""The host tier's default size: the machine's memory (physical, or the cgroup's limit where
lower, read from real files in a fake cgroup tree) over the nodes that share the machine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pd.executor import host_pool
from pd.executor.config import EngineConfig
from pd.executor.host_pool import cgroup_memory_limit, host_tier_slots, machine_memory_bytes

GIB = 1 << 30
PHYSICAL = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
V1_UNLIMITED = 9223372036854771712  # what cgroup v1 writes for "no limit"


def _cgroup(root: Path, rel: str, name: str, value: str) -> None:
    d = root / rel
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(value + "\n")


def _self(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "self-cgroup"
    path.write_text(text)
    return path


def test_v2_takes_the_lowest_limit_of_the_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _cgroup(root, "", "memory.max", "max")
    _cgroup(root, "kubepods", "memory.max", str(3 * GIB))
    _cgroup(root, "kubepods/pod1", "memory.max", "max")
    _cgroup(root, "kubepods/pod1/c1", "memory.max", str(5 * GIB))
    me = _self(tmp_path, "0::/kubepods/pod1/c1\n")
    assert cgroup_memory_limit(root, me) == 3 * GIB
    # "max" all the way up: no limit
    (root / "kubepods" / "memory.max").write_text("max\n")
    (root / "kubepods/pod1/c1" / "memory.max").write_text("max\n")
    assert cgroup_memory_limit(root, me) is None


def test_v2_in_a_container_reads_the_root(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _cgroup(root, "", "memory.max", str(2 * GIB))
    assert cgroup_memory_limit(root, _self(tmp_path, "0::/\n")) == 2 * GIB


def test_v1_reads_the_memory_controller_and_its_unlimited_is_no_limit(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _cgroup(root, "memory", "memory.limit_in_bytes", str(V1_UNLIMITED))
    text = "9:cpu,cpuacct:/x\n4:memory:/docker/abc\n0::/\n"
    me = _self(tmp_path, text)
    # the container's own directory is not visible (a cgroup namespace): the mount's top
    assert cgroup_memory_limit(root, me) == V1_UNLIMITED
    _cgroup(root, "memory/docker/abc", "memory.limit_in_bytes", str(GIB + 4096))
    assert cgroup_memory_limit(root, me) == GIB + 4096


def test_no_cgroup_file_system_is_no_limit(tmp_path: Path) -> None:
    assert cgroup_memory_limit(tmp_path / "none", tmp_path / "no-such-file") is None
    assert cgroup_memory_limit(tmp_path, _self(tmp_path, "garbage\n")) is None


@pytest.fixture
def limited(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """This process in a fake v2 cgroup of 6 GiB (under physical memory, if the machine has
    more), as ``machine_memory_bytes`` reads it."""
    limit = min(6 * GIB, PHYSICAL // 2)
    root = tmp_path / "cg"
    _cgroup(root, "", "memory.max", "max")
    _cgroup(root, "pd.slice", "memory.max", str(limit))
    monkeypatch.setattr(host_pool, "CGROUP_ROOT", root)
    monkeypatch.setattr(host_pool, "PROC_SELF_CGROUP", _self(tmp_path, "0::/pd.slice\n"))
    return limit


def test_the_machines_memory_is_the_lower_of_physical_and_the_cgroups(limited: int) -> None:
    assert machine_memory_bytes() == limited
    (host_pool.CGROUP_ROOT / "pd.slice" / "memory.max").write_text(str(4 * PHYSICAL))
    assert machine_memory_bytes() == PHYSICAL


@pytest.mark.parametrize("machine_nodes", [1, 3, 8])
def test_the_default_tier_is_an_eighth_of_the_nodes_share(limited: int, machine_nodes: int) -> None:
    cfg = EngineConfig(max_total_tokens=1 << 30)  # the pool bound never binds here
    per_token = 4096
    got = host_tier_slots(cfg, per_token, machine_nodes)
    assert got == limited // machine_nodes // 8 // per_token
    # what the tier may take, together, stays within an eighth of the cgroup's limit
    assert machine_nodes * got * per_token <= limited // 8
    # set explicitly, or off: as set
    assert host_tier_slots(EngineConfig(host_cache_tokens=64), per_token, machine_nodes) == 64
    assert host_tier_slots(EngineConfig(enable_prefix_cache=False, host_cache_tokens=0), 1) == 0
    with pytest.raises(ValueError, match="machine_nodes must be >= 1, got 0"):
        host_tier_slots(cfg, per_token, 0)
