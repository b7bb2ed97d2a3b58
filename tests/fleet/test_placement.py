"""How many nodes of a pool a Ray cluster can hold (``pd.fleet.placement``), from its
resources as Ray reports them; no Ray here. The live refusal is in test_admin_live.py."""

from __future__ import annotations

import pytest

from pd.fleet.placement import (
    Capacity,
    max_nodes,
    node_demand,
    pool_capacity,
    socket_capacity,
)

pytestmark = pytest.mark.timeout(30)


MIB = 2**20


def test_a_node_takes_what_it_asks_ray_for_or_its_memory() -> None:
    assert node_demand(1.0, {}, 500 * MIB) == {"CPU": 1.0, "GPU": 1.0}
    assert node_demand(0.5, {"prefill": 1.0}, 1) == {"CPU": 1.0, "GPU": 0.5, "prefill": 1.0}
    assert node_demand(0.0, {"decode": 1.0}, 1) == {"decode": 1.0}  # CPU nodes ask num_cpus=0
    # asks Ray for nothing: counted as its memory (CPU nodes share cores)
    assert node_demand(0.0, {}, 500 * MIB) == {"memory": 500.0 * MIB}


def test_cpu_nodes_are_bounded_by_memory_not_cores() -> None:
    """Two cores hold a 2P2D cluster (nodes share cores); 24 GiB hold what their memory
    allows, and the message says it in GiB."""
    node = node_demand(0.0, {}, 768 * MIB)
    totals = {"CPU": 2.0, "memory": 24.0 * 2**30}
    cap = pool_capacity("prefill", node, "decode", node, 2, totals, None)
    assert cap.max_nodes == 30  # 32 nodes of 0.75 GiB, 2 of them decode
    assert cap.why == (
        "a prefill node takes memory 0.75 GiB; the cluster has memory 24.00 GiB, "
        "of which the 2 decode node(s) hold memory 1.50 GiB"
    )


def test_the_scarcest_resource_bounds_the_pool() -> None:
    assert max_nodes({"CPU": 64, "GPU": 8}, {"CPU": 1, "GPU": 1}, {}) == 8
    assert max_nodes({"CPU": 64, "GPU": 8}, {"CPU": 1, "GPU": 1}, {"CPU": 3, "GPU": 3}) == 5
    assert max_nodes({"CPU": 64, "GPU": 8}, {"CPU": 1, "GPU": 0.5}, {}) == 16
    assert max_nodes({"CPU": 4, "GPU": 0.3 * 10}, {"GPU": 0.3}, {}) == 10  # no float shortfall
    assert max_nodes({"CPU": 4}, {"prefill": 1}, {}) == 0  # no machine with the role's resource
    assert max_nodes({"CPU": 2}, {"CPU": 1}, {"CPU": 3}) == 0  # never negative


def test_the_other_pool_holds_its_share_and_the_message_says_the_numbers() -> None:
    gpu = node_demand(1.0, {}, 1)
    cap = pool_capacity("prefill", gpu, "decode", gpu, 3, {"CPU": 96, "GPU": 8}, None)
    assert cap.max_nodes == 5
    assert cap.why == (
        "a prefill node takes CPU 1, GPU 1; the cluster has CPU 96, GPU 8, "
        "of which the 3 decode node(s) hold CPU 3, GPU 3"
    )
    # role resources: the other pool holds none of them
    p, d = node_demand(0.0, {"prefill": 1.0}, 1), node_demand(0.0, {"decode": 1.0}, 1)
    cap = pool_capacity("prefill", p, "decode", d, 2, {"prefill": 4, "decode": 4}, None)
    assert cap == (4, "a prefill node takes prefill 1; the cluster has prefill 4")


def test_what_rays_autoscaler_may_add_counts() -> None:
    """Ray's autoscaler reports the most of each resource its node types' max_workers give;
    the alive nodes are the floor (a head type reports no max of its own)."""
    gpu = node_demand(1.0, {"prefill": 1.0}, 1)
    alive = {"CPU": 8, "GPU": 1, "prefill": 1}
    grown = {"CPU": 40, "GPU": 5, "prefill": 5}
    assert pool_capacity("prefill", gpu, "decode", gpu, 1, alive, None).max_nodes == 0
    cap = pool_capacity("prefill", gpu, "decode", gpu, 1, alive, grown)
    assert cap.max_nodes == 4  # 5 GPUs, one for the decode node
    assert "(as far as Ray's autoscaler may grow it)" in cap.why
    assert pool_capacity("prefill", gpu, "decode", gpu, 1, alive, {"GPU": 0}).max_nodes == 0


def test_threads_per_node_come_from_the_cluster_then_num_threads_then_the_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pd.executor.config import EngineConfig
    from pd.fleet.config import ClusterConfig
    from pd.fleet.launcher import Cluster
    from pd.router.policy import CoordinatorConfig

    monkeypatch.setattr("os.cpu_count", lambda: 8)

    def threads(
        num_threads: int | None, threads_per_node: int | None = None, num_decode: int = 3
    ) -> int | None:
        cfg = ClusterConfig(num_prefill=1, num_decode=num_decode, threads_per_node=threads_per_node)
        cluster = Cluster(EngineConfig(num_threads=num_threads), cfg, CoordinatorConfig())
        return cluster.actors.threads(cluster.engine_cfg)

    assert threads(None) == 2  # 8 cores over the 3 decode nodes: a prefill node shares them
    assert threads(None, num_decode=1) == 8  # 1 prefill + 1 decode: all the cores each
    assert threads(3) == 3  # --num-threads: each node's, as the user asked
    assert threads(3, threads_per_node=1) == 1


def test_a_pool_is_bounded_by_the_connections_each_socket_takes() -> None:
    """32 connections a socket (``--transfer-max-conns``): 31 nodes, the server the 32nd."""
    roomy = Capacity(100, "a prefill node takes memory 0.75 GiB; ...")
    cap = socket_capacity(roomy, 3, 32)
    assert cap.max_nodes == 28
    assert cap.why == (
        "each internal socket takes 32 connections (--transfer-max-conns): at most 31 nodes, "
        "3 of them in the other pool"
    )
    tight = Capacity(5, "memory")
    assert socket_capacity(tight, 3, 32) is tight  # Ray's bound is the lower
    assert socket_capacity(roomy, 40, 32).max_nodes == 0


def test_a_node_of_n_ranks_takes_n_gpus_of_one_machine_and_the_pools_count_them() -> None:
    from pd.executor.config import EngineConfig
    from pd.fleet.config import ClusterConfig
    from pd.fleet.launcher import Cluster
    from pd.router.policy import CoordinatorConfig

    cfg = ClusterConfig(num_prefill=1, num_decode=2, prefill_tensor_parallel_size=4)
    cluster = Cluster(EngineConfig(tensor_parallel_size=2), cfg, CoordinatorConfig())
    cluster.actors.gpus = 1.0  # as connect() resolves it on a cluster with GPUs
    prefill = cluster.actors.gpus_of("prefill", cluster.engine_cfg)
    decode = cluster.actors.gpus_of("decode", cluster.engine_cfg)
    assert (prefill, decode) == (4.0, 2.0)
    # 8 GPUs (one machine of 8): a TP-4 prefill node beside two TP-2 decode nodes fills it
    cap = pool_capacity(
        "prefill",
        node_demand(prefill, {}, 0),
        "decode",
        node_demand(decode, {}, 0),
        2,
        {"CPU": 64, "GPU": 8},
        None,
    )
    assert cap.max_nodes == 1
    assert "a prefill node takes CPU 1, GPU 4" in cap.why and "hold CPU 2, GPU 4" in cap.why
