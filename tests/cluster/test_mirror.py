"""The coordinator's mirror of each node's cache stays exact: a gap in a node's cache events gets
the node asked for a snapshot, and a node the server attaches to (it ran before the server) is
not routed to until its snapshot is in. ``ClusterClient`` against fake nodes; no model, no Ray."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest
import zmq.asyncio

from pd.cluster.client import ClusterClient
from pd.cluster.client_config import ClientConfig
from pd.core.messages import CacheEventMsg
from pd.router.coordinator import Coordinator
from pd.router.policy import CoordinatorConfig
from tests.cluster.test_client import SECRET, FakeNode
from tests.conftest import free_port

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]
PATH = [7, 8, 9, 10, 11, 12]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Nodes:
    """Fake nodes that answer a snapshot request with ``snapshot[node_id]`` (or nothing)."""

    def __init__(self, client: ClusterClient, ctx: zmq.asyncio.Context) -> None:
        self.client, self.ctx = client, ctx
        self.nodes: dict[str, FakeNode] = {}
        self.asked: list[str] = []
        self.snapshot: dict[str, list[CacheEventMsg]] = {}
        self.silent: set[str] = set()  # say they sent a snapshot, send nothing

    def add(self, node_id: str, attached: bool = False) -> FakeNode:
        node = self.nodes[node_id] = FakeNode(self.ctx, node_id, self.client.pull_addr, 1000)
        self.client.membership.register_node(node.info, attached=attached)
        node.beat()
        return node

    async def resync(self, node_id: str) -> int:
        self.asked.append(node_id)
        if node_id in self.silent:
            return 1
        events = self.snapshot.get(node_id, [])
        for event in events:
            self.nodes[node_id].send(event)
        return len(events)


@contextlib.asynccontextmanager
async def _client() -> AsyncIterator[Nodes]:
    port = free_port()
    ctx = zmq.asyncio.Context()
    holder: list[Nodes] = []
    client = ClusterClient(
        Coordinator(CoordinatorConfig(local_prefill_tokens=-1)),
        f"tcp://127.0.0.1:{port}",
        ClientConfig(heartbeat_timeout_s=60.0, watch_interval_s=0.05),
        secret=SECRET,
        resync=lambda node_id: holder[0].resync(node_id),
    )
    nodes = Nodes(client, ctx)
    holder.append(nodes)
    await client.start()
    try:
        yield nodes
    finally:
        await client.close()
        for node in nodes.nodes.values():
            node.close()
        ctx.term()


async def _until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def _event(node_id: str, seq: int, kind: str, tokens: list[int]) -> CacheEventMsg:
    return CacheEventMsg(node_id=node_id, seq=seq, kind=kind, namespace="", tokens=tokens)


async def test_a_gap_in_the_cache_events_gets_a_snapshot_and_the_mirror_is_exact_again() -> None:
    async with _client() as n:
        p = n.add("prefill-0")
        n.add("decode-0")
        index = n.client.coordinator.index("prefill-0")
        p.send(_event("prefill-0", 0, "inserted", [1, 2, 3]))
        await _until(lambda: index.match_len([1, 2, 3, 4]) == 3)
        # seq 1 is lost: seq 2 (and everything after) is out of step
        p.send(_event("prefill-0", 2, "inserted", PATH))
        await _until(lambda: n.asked == ["prefill-0"])
        assert index.needs_resync and index.match_len(PATH + [1]) == 0
        # the node's snapshot: its cache holds the lost path and the late one, not [1, 2, 3]
        p.send(_event("prefill-0", 3, "reset", []))
        p.send(_event("prefill-0", 4, "inserted", [4, 5]))
        p.send(_event("prefill-0", 5, "inserted", PATH))
        await _until(lambda: index.match_len(PATH + [1]) == len(PATH))
        assert not index.needs_resync
        assert index.match_len([1, 2, 3, 4]) == 0 and index.match_len([4, 5, 6]) == 2
        assert index.num_cached_tokens == 2 + len(PATH)
        await asyncio.sleep(0.3)  # several watch intervals: nobody is asked again
        assert n.asked == ["prefill-0"] and n.client.mirror.num_requested == 1


async def test_an_attached_node_is_routed_to_only_once_its_snapshot_is_in() -> None:
    async with _client() as n:
        n.snapshot["prefill-0"] = [
            _event("prefill-0", 40, "reset", []),
            _event("prefill-0", 41, "inserted", PATH),
        ]
        n.add("prefill-0", attached=True)
        n.add("decode-0", attached=True)  # keeps no prefix cache: its answer is 0 events
        await _until(lambda: sorted(n.asked) == ["decode-0", "prefill-0"])
        await _until(lambda: n.client.mirror.is_settled)
        assert await n.client.is_ready()
        index = n.client.coordinator.index("prefill-0")
        assert index.match_len(PATH + [99]) == len(PATH) and index.next_seq == 42
        # events older than the snapshot (sent before it, read after) change nothing
        n.nodes["prefill-0"].send(_event("prefill-0", 39, "inserted", [1, 2, 3]))
        n.nodes["prefill-0"].send(_event("prefill-0", 42, "inserted", [1, 2]))
        await _until(lambda: index.next_seq == 43)
        assert index.match_len([1, 2, 3]) == 2


async def test_an_unanswered_snapshot_request_is_asked_again_and_health_waits() -> None:
    async with _client() as n:
        n.client.mirror.retry_s = 0.2
        n.silent.add("prefill-0")
        n.add("prefill-0", attached=True)
        n.add("decode-0")
        await _until(lambda: n.asked.count("prefill-0") >= 3, timeout=3.0)
        assert not await n.client.is_ready()
        n.nodes["prefill-0"].send(_event("prefill-0", 0, "reset", []))
        await _until(lambda: n.client.mirror.is_settled)
        assert await n.client.is_ready()
