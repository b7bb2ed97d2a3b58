"""The watchdog pings only the nodes silent since its last look: a node that beats costs no
Ray call; one that stops is pinged and, its actor gone, found dead well before its heartbeat
timeout."""

from __future__ import annotations

import asyncio
import time

import pytest

from pd.cluster.liveness import Liveness

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_beating_nodes_are_not_pinged_and_a_silent_dead_one_is_found_at_once() -> None:
    pinged: list[str] = []
    gone: set[str] = set()
    dead: dict[str, float] = {}

    async def ping(node_id: str) -> None:
        pinged.append(node_id)
        if node_id in gone:
            raise RuntimeError(f"the actor of {node_id} died")

    liveness = Liveness(60.0, 0.05, 1.0, ping, lambda n, why: dead.setdefault(n, time.monotonic()))
    for node_id in ("a", "b"):
        liveness.watch(node_id)
    watchdog = asyncio.ensure_future(liveness.run())
    try:
        for _ in range(40):  # 20 looks: both beat every 0.025 s
            await asyncio.sleep(0.025)
            liveness.heard("a")
            liveness.heard("b")
        assert pinged == [] and dead == {}
        gone.add("b")
        stopped = time.monotonic()
        while "b" not in dead:  # "b" beats no more; "a" still does
            assert time.monotonic() - stopped < 20.0, "the silent node was not found dead"
            await asyncio.sleep(0.025)
            liveness.heard("a")
        assert set(pinged) == {"b"} and list(dead) == ["b"]
        # by its failed ping (a look or two), not by the 60 s heartbeat timeout
    finally:
        watchdog.cancel()
        await asyncio.gather(watchdog, return_exceptions=True)
