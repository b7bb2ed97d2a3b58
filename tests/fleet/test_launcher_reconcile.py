"""The launcher's reconcile (``Cluster._reconcile``) without Ray: a start counts from the
moment reconcile asks for it, so reconciles in quick succession (a scale right after a drain,
a node joining meanwhile) start each missing node once."""

from __future__ import annotations

import asyncio

import pytest

from pd.executor.config import EngineConfig
from pd.fleet.config import ClusterConfig
from pd.fleet.launcher import Cluster
from pd.fleet.pools import NodeState, PoolNode
from pd.router.policy import CoordinatorConfig

pytestmark = pytest.mark.timeout(30)


def test_reconciles_before_a_start_has_run_start_each_missing_node_once() -> None:
    async def main() -> list[str]:
        cluster = Cluster(
            EngineConfig(), ClusterConfig(num_prefill=1, num_decode=2), CoordinatorConfig()
        )
        started: list[str] = []
        never: asyncio.Future[object] = asyncio.get_running_loop().create_future()

        def fake_start(node: PoolNode, *args: object) -> asyncio.Future[object]:
            started.append(node.role)
            return never  # never up: the start stays under way

        cluster.actors.start = fake_start  # type: ignore[method-assign,assignment]
        cluster._reconcile()
        cluster._reconcile()  # before the loop has run anything the first one asked for
        for _ in range(5):
            await asyncio.sleep(0)
        cluster.scale(decode=2)  # the same targets again: nothing more to start
        for _ in range(5):
            await asyncio.sleep(0)
        starting = cluster.pools.nodes(NodeState.STARTING)
        assert sorted(n.role for n in starting) == ["decode", "decode", "prefill"]
        await cluster._tasks.cancel_all()
        return started

    assert sorted(asyncio.run(main())) == ["decode", "decode", "prefill"]
