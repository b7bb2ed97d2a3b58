"""The host tier's share reaches the node: the launcher counts the nodes that share the machine,
and a node started with that count gets its share of the (cgroup-limited) memory, no more."""

from __future__ import annotations

from pathlib import Path

import pytest

from decode.node import DecodeRole
from pd.executor import host_pool
from pd.executor.config import EngineConfig
from pd.fleet.actors import NodeActors
from pd.fleet.config import ClusterConfig
from pd.fleet.pools import Pools
from pd.node import Node, NodeConfig
from tests.node.harness import SECRET
from transfer.state import TransferConfig

pytestmark = pytest.mark.timeout(120)


def test_a_node_gets_its_share_of_the_cgroups_memory(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the launcher of a local cluster of 2 prefill + 1 decode nodes: all share this machine
    actors = NodeActors(ClusterConfig(num_prefill=2, num_decode=1), Pools(2, 1))
    machine_nodes = actors.machine_nodes()
    assert machine_nodes == 3

    cfg = EngineConfig(model=str(tiny_llama_dir), max_total_tokens=4096, page_size=4)
    # a cgroup small enough that the share, not 4 pools, bounds the tier
    limit = 24 * 2**20 + 12345
    (tmp_path / "pd.slice").mkdir()
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "pd.slice" / "memory.max").write_text(f"{limit}\n")
    (tmp_path / "self").write_text("0::/pd.slice\n")
    monkeypatch.setattr(host_pool, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(host_pool, "PROC_SELF_CGROUP", tmp_path / "self")

    node_cfg = NodeConfig(
        "decode-share",
        "tcp://127.0.0.1:9",  # nothing listens: the node only queues what it would send
        machine_nodes=machine_nodes,
        transfer=TransferConfig(backend="fake", secret=SECRET),
    )
    node = Node(cfg, node_cfg, DecodeRole)
    try:
        tier = node.core.cache.tier_stats
        per_token = node.core.runner.pool.num_bytes_per_token
        assert tier is not None
        share = limit // machine_nodes // 8 // per_token
        assert tier.num_slots == share // cfg.page_size * cfg.page_size  # whole pages
        assert 0 < tier.num_slots < host_pool.DEFAULT_POOL_MULTIPLE * cfg.max_total_tokens
        # alone on the machine it would have got three times as much
        assert host_pool.host_tier_slots(cfg, per_token, 1) == limit // 8 // per_token
    finally:
        node.shutdown()
