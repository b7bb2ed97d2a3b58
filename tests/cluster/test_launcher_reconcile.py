"""The launcher's reconcile (``Cluster._reconcile``) without Ray: a start counts from the
moment reconcile asks for it, so reconciles in quick succession (a scale right after a drain,
a node joining meanwhile) start each missing node once."""

from __future__ import annotations

import asyncio

import pytest

from pd.cluster.coordinator import CoordinatorConfig
from pd.cluster.launcher import Cluster, ClusterConfig, LaunchedNode
from pd.engine.config import EngineConfig

pytestmark = pytest.mark.timeout(30)


def test_reconciles_before_a_start_has_run_start_each_missing_node_once() -> None:
    async def main() -> list[str]:
        cluster = Cluster(
            EngineConfig(), ClusterConfig(num_prefill=1, num_decode=2), CoordinatorConfig()
        )
        started: list[str] = []
        never: asyncio.Future[object] = asyncio.get_running_loop().create_future()

        def fake_start_actor(role: str) -> tuple[str, asyncio.Future[object]]:
            node = LaunchedNode(role, len(started))
            started.append(role)
            cluster.launched[node.node_id] = node
            cluster.starting[node.node_id] = role
            return node.node_id, never  # never up: the start stays under way

        cluster._start_actor = fake_start_actor  # type: ignore[method-assign]
        cluster._reconcile()
        cluster._reconcile()  # before the loop has run anything the first one asked for
        for _ in range(5):
            await asyncio.sleep(0)
        cluster.scale(decode=2)  # the same targets again: nothing more to start
        for _ in range(5):
            await asyncio.sleep(0)
        assert sorted(cluster.starting.values()) == ["decode", "decode", "prefill"]
        for task in list(cluster._tasks):
            task.cancel()
        await asyncio.gather(*cluster._tasks, return_exceptions=True)
        return started

    assert sorted(asyncio.run(main())) == ["decode", "decode", "prefill"]
