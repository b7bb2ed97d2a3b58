"""``ClusterClient`` against fake nodes (their sockets, driven by the test): routing waits,
re-routes after a node death, heartbeats, and a reader that survives any message. No model,
no Ray."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from pd.cluster.client import ClusterClient
from pd.cluster.client_config import ClientConfig
from pd.cluster.flights import ClusterError, RequestRefused
from pd.core.messages import (
    AbortMsg,
    CacheEventMsg,
    DecodeReqMsg,
    LocalReqMsg,
    NodeInfo,
    NodeMsg,
    PeerGoneMsg,
    PeerUpMsg,
    PrefillReqMsg,
    TokenMsg,
)
from pd.core.outputs import RequestOutput
from pd.core.sampling_params import SamplingParams
from pd.router.coordinator import Coordinator
from pd.router.policy import CoordinatorConfig
from pd.server.metrics import ServerMetrics
from tests.conftest import make_node_stats
from transfer.auth import Opener, Sealer, new_secret

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]
SECRET = new_secret()
PARAMS = SamplingParams(max_tokens=40, temperature=0.0)
PROMPT = list(range(1, 11))  # 10 tokens: prompt + max_tokens = 50 slots on a decode node


def _event(node_id: str, seq: int, tokens: list[int]) -> CacheEventMsg:
    return CacheEventMsg(node_id=node_id, seq=seq, kind="inserted", namespace="", tokens=tokens)


class FakeNode:
    """A node's two sockets: what the client sends it, and what the test makes it send."""

    def __init__(self, ctx: zmq.asyncio.Context, node_id: str, server_addr: str, slots: int):
        self.node_id = node_id
        self.pull = ctx.socket(zmq.PULL)
        port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.push = ctx.socket(zmq.PUSH)
        self.push.connect(server_addr)
        role = node_id.split("-")[0]
        addr = f"tcp://127.0.0.1:{port}"
        self.info = NodeInfo(
            node_id=node_id,
            role=role,
            addr=addr,
            transfer_addr="tcp://127.0.0.1:9",
            num_slots=slots,
            max_model_len=4096,
        )
        self._opener = Opener(SECRET, addr)
        self._sealer = Sealer(SECRET, server_addr)
        self._decoder = msgspec.msgpack.Decoder(NodeMsg)
        self._offsets: dict[str, int] = {}  # by request id: the tokens sent

    async def recv(self, timeout: float = 5.0) -> Any:
        raw = self._opener.open(await asyncio.wait_for(self.pull.recv(), timeout))
        assert raw is not None, self._opener.drops
        return self._decoder.decode(raw)

    async def recv_until(self, kind: type, timeout: float = 5.0) -> Any:
        """The next message of ``kind`` (others before it are skipped)."""
        while not isinstance(msg := await self.recv(timeout), kind):
            pass
        return msg

    def send(self, msg: Any) -> None:
        self.send_raw(msgspec.msgpack.encode(msg))

    def send_raw(self, payload: bytes) -> None:
        """An authentic frame around ``payload``, whatever it holds."""
        self.push.send(self._sealer.seal(payload))

    def tokens(
        self, rid: str, ids: list[int], finished: bool = False, offset: int | None = None
    ) -> None:
        """``ids`` of ``rid``'s output, after those sent before (or from ``offset``)."""
        reason = "length" if finished else None
        offset = self._offsets.get(rid, 0) if offset is None else offset
        self._offsets[rid] = offset + len(ids)
        msg = _token_msg(rid, ids, node_id=self.node_id, finished=finished, reason=reason)
        self.send(msgspec.structs.replace(msg, offset=offset))

    def fails(
        self, rid: str, error: str, can_retry: bool = False, is_refused: bool = False
    ) -> None:
        """``rid`` failed here: ``can_retry`` when its KV transfer did, not the request;
        ``is_refused`` when the request itself is at fault (its grammar)."""
        msg = _token_msg(
            rid,
            [],
            node_id=self.node_id,
            finished=True,
            reason="abort",
            error=error,
            can_retry=can_retry,
        )
        self.send(msgspec.structs.replace(msg, is_refused=is_refused))

    def beat(self) -> None:
        role = self.info.role
        self.send(make_node_stats(self.node_id, role, num_slots=100, num_free_slots=100))

    def close(self) -> None:
        self.pull.close(linger=0)
        self.push.close(linger=0)


def _token_msg(
    rid: str,
    ids: list[int],
    *,
    node_id: str,
    finished: bool,
    reason: str | None,
    error: str | None = None,
    can_retry: bool = False,
) -> TokenMsg:
    return TokenMsg(
        request_id=rid,
        offset=0,
        token_ids=ids,
        finished=finished,
        finish_reason=reason,
        num_prompt_tokens=len(PROMPT),
        num_cached_tokens=0,
        error=error,
        node_id=node_id,
        can_retry=can_retry,
    )


class Harness:
    def __init__(self, client: ClusterClient, ctx: zmq.asyncio.Context) -> None:
        self.client, self.ctx = client, ctx
        self.nodes: dict[str, FakeNode] = {}
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.errors: dict[str, BaseException] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def add(self, node_id: str, slots: int = 1000) -> FakeNode:
        node = self.nodes[node_id] = FakeNode(self.ctx, node_id, self.client.pull_addr, slots)
        self.client.membership.register_node(node.info)
        node.beat()
        return node

    def request(self, rid: str, params: SamplingParams = PARAMS) -> None:
        async def run() -> None:
            outs = self.outputs.setdefault(rid, [])
            try:
                stream: AsyncIterator[RequestOutput] = self.client.generate(rid, PROMPT, params)
                async for out in stream:
                    outs.append(out)
            except Exception as e:  # the test looks at it
                self.errors[rid] = e

        self.tasks[rid] = asyncio.ensure_future(run())

    async def wait_done(self, rid: str, timeout: float = 5.0) -> None:
        await asyncio.wait_for(asyncio.shield(self.tasks[rid]), timeout)

    def tokens_of(self, rid: str) -> list[int]:
        return [t for out in self.outputs.get(rid, []) for t in out.new_token_ids]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextlib.asynccontextmanager
async def _harness(**cfg: Any) -> AsyncIterator[Harness]:
    cfg.setdefault("heartbeat_timeout_s", 60.0)
    cfg.setdefault("watch_interval_s", 0.05)
    coordinator = Coordinator(CoordinatorConfig(policy="round_robin", local_prefill_tokens=-1))
    ctx = zmq.asyncio.Context()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addr = f"tcp://127.0.0.1:{port}"
    client = ClusterClient(coordinator, addr, ClientConfig(**cfg), secret=SECRET)
    await client.start()
    h = Harness(client, ctx)
    try:
        yield h
    finally:
        for task in h.tasks.values():
            task.cancel()
        await asyncio.gather(*h.tasks.values(), return_exceptions=True)
        await client.close()
        for node in h.nodes.values():
            node.close()
        ctx.term()


async def _until(cond: Any, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_reader_survives_any_message_and_keeps_streaming(monkeypatch) -> None:
    async with _harness() as h:
        p, d = h.add("prefill-0"), h.add("decode-0")
        h.request("r1")
        assert (await d.recv_until(DecodeReqMsg)).request_id == "r1"
        assert (await p.recv_until(PrefillReqMsg)).request_id == "r1"
        real_apply = h.client.coordinator.apply_event

        def apply(event: CacheEventMsg) -> None:
            if event.seq == 7:
                raise RuntimeError("injected handler failure")
            real_apply(event)

        monkeypatch.setattr(h.client.coordinator, "apply_event", apply)
        p.send(b"\x00not msgpack")  # malformed
        p.send(msgspec.msgpack.encode({"type": "no_such_tag", "x": 1}))  # unknown
        p.send(_event("prefill-0", 7, [1, 2]))  # its handler raises
        p.send(_event("prefill-0", 9, [1, 2, 3]))  # out of order
        p.send(_event("prefill-9", 0, [1]))  # unknown node
        unknown_id = _token_msg("nobody", [1], node_id="decode-0", finished=True, reason="stop")
        not_its_node = _token_msg("r1", [98], node_id="decode-7", finished=False, reason=None)
        p.send(unknown_id)
        d.send(not_its_node)
        d.tokens("r1", [5])
        d.tokens("r1", [6, 7], finished=True)
        await h.wait_done("r1")
        assert "r1" not in h.errors and h.tokens_of("r1") == [5, 6, 7]
        assert h.client.sockets.num_bad_msgs == 3  # malformed, unknown tag, the raising handler
        metrics = ServerMetrics()
        metrics.update_stats(h.client.stats())
        assert "pd_server_dropped_messages 3.0" in metrics.render().decode()
        assert h.client.sockets.num_reader_restarts == 0 and await h.client.is_ready()


async def test_reader_restarts_and_health_is_unready_until_it_reads_again(monkeypatch) -> None:
    async with _harness() as h:
        p, _ = h.add("prefill-0"), h.add("decode-0")
        await _until(lambda: h.client.sockets.is_reading)
        assert await h.client.is_ready()
        reader = h.client.sockets._reader
        assert reader is not None
        real_read = reader.read
        calls = {"n": 0}

        def read() -> Any:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected reader failure")
            return real_read()

        monkeypatch.setattr(reader, "read", read)
        p.beat()  # wakes the reader: its first read() now raises
        await _until(lambda: h.client.sockets.num_reader_restarts == 1)
        assert not await h.client.is_ready()
        p.beat()
        await _until(lambda: h.client.sockets.is_reading)
        assert await h.client.is_ready()
        assert h.client.stats().num_reader_restarts == 1


async def test_requests_wait_in_fifo_order_for_room_until_their_deadline() -> None:
    async with _harness(request_timeout_s=1.5) as h:
        p, d = h.add("prefill-0"), h.add("decode-0", slots=100)  # room for two requests
        for rid in ("r1", "r2"):
            h.request(rid)
            assert (await p.recv_until(PrefillReqMsg)).request_id == rid
        h.request("r3")
        await _until(lambda: h.client.stats().num_queued == 1)
        h.request("r4")
        await _until(lambda: h.client.stats().num_queued == 2)
        d.tokens("r1", [1], finished=True)  # room for one: the first in line gets it
        assert (await p.recv_until(PrefillReqMsg)).request_id == "r3"
        for rid in ("r2", "r3", "r4"):  # no node answers them: each ends at its deadline
            await h.wait_done(rid, timeout=5.0)
            assert isinstance(h.errors[rid], TimeoutError), h.errors
            assert "deadline (1.5 s)" in str(h.errors[rid])
        assert h.client.stats().num_queued == 0
        assert not h.client.coordinator._requests  # nothing stays booked
        aborts = [m.request_id for m in await _drain(p) if isinstance(m, AbortMsg)]
        assert {"r2", "r3"} <= set(aborts)  # the nodes were told to forget them


async def test_thirty_two_requests_without_max_tokens_go_to_one_decode_node_at_once() -> None:
    """The path where a booking binds: the client's dispatch, the room queue, the coordinator.
    32 requests without max_tokens (each given the rest of a 4,096-token context) and one
    decode node of 32,768 slots: all 32 are sent at once, none waits (booking prompt +
    max_tokens sent 8 and queued 24). The bookings grow with the tokens the node streams,
    and all of them, grown, are released when the answers end."""
    n, ctx, slots = 32, 4096, 32768
    params = SamplingParams(max_tokens=ctx - len(PROMPT), temperature=0.0)
    async with _harness() as h:
        p, d = h.add("prefill-0"), h.add("decode-0", slots=slots)
        coord = h.client.coordinator
        for i in range(n):
            h.request(f"r{i}", params)
        sent = [(await p.recv_until(PrefillReqMsg)).request_id for _ in range(n)]
        assert sorted(sent) == sorted(f"r{i}" for i in range(n))
        assert h.client.stats().num_queued == 0
        assert coord.nodes.num_reserved_slots("decode-0") == n * (len(PROMPT) + 512)
        for i in range(n):
            d.tokens(f"r{i}", [5] * 600)  # past the first 512: booked for as many again
        await _until(lambda: coord.nodes.num_reserved_slots("decode-0") == n * (len(PROMPT) + 1200))
        coord.check_integrity()
        for i in range(n):
            d.tokens(f"r{i}", [5], finished=True)
        for i in range(n):
            await h.wait_done(f"r{i}")
            assert len(h.tokens_of(f"r{i}")) == 601
        assert coord.nodes.num_reserved_slots("decode-0") == 0 and not h.errors
        coord.check_integrity()


async def _drain(node: FakeNode) -> list[Any]:
    msgs = []
    with contextlib.suppress(TimeoutError):
        while True:
            msgs.append(await node.recv(timeout=0.2))
    return msgs


async def test_a_node_that_registers_is_announced_to_the_others_before_its_first_request() -> None:
    """The kernel may give a replacement node the port of the node it replaces, which the
    others refuse for a while: they hear it joined (``PeerUpMsg``) before any request for it."""
    async with _harness() as h:
        p = h.add("prefill-0")
        d = h.add("decode-0")
        h.request("r")
        msgs = await _drain(p)
        up = PeerUpMsg(node_id="decode-0", addr=d.info.addr, transfer_addr=d.info.transfer_addr)
        first = next(i for i, m in enumerate(msgs) if isinstance(m, PrefillReqMsg))
        assert up in msgs[:first], msgs
        assert not [m for m in await _drain(d) if isinstance(m, PeerUpMsg)]  # not about itself


def test_the_nodes_a_cluster_starts_with_register_before_the_client_binds() -> None:
    """The launcher registers a cluster's first nodes before the server binds its sockets:
    announcing each to the others then is nothing (it raised "bind() first" and failed every
    ``pd serve`` with two nodes or more)."""
    coordinator = Coordinator(CoordinatorConfig(policy="round_robin", local_prefill_tokens=-1))
    client = ClusterClient(coordinator, "tcp://127.0.0.1:1", ClientConfig(), secret=SECRET)
    for i, node_id in enumerate(("prefill-0", "decode-0", "decode-1")):
        client.membership.register_node(
            NodeInfo(
                node_id=node_id,
                role=node_id.split("-")[0],
                addr=f"tcp://127.0.0.1:{10 + i}",
                transfer_addr=f"tcp://127.0.0.1:{20 + i}",
                num_slots=64,
                max_model_len=4096,
            )
        )
    assert list(client.membership.nodes) == ["prefill-0", "decode-0", "decode-1"]


async def test_a_dead_decode_node_reroutes_unstarted_requests_and_fails_over_streamed_ones() -> (
    None
):
    async with _harness() as h:
        p = h.add("prefill-0")
        survivor, victim = h.add("decode-0", slots=100), h.add("decode-1", slots=1000)
        for rid in ("streamed", "waiting"):  # both go to the node with the most room
            h.request(rid)
            assert (await p.recv_until(PrefillReqMsg)).decode_node == victim.node_id
        victim.tokens("streamed", [4, 5])
        await _until(lambda: h.tokens_of("streamed") == [4, 5])
        h.client.membership.fail_node(victim.node_id, "killed by the test")
        # the prefill node forgets both attempts, hears the node is gone, and gets the
        # request that streamed nothing again, under a new wire id, bound for the survivor
        msgs = await _drain(p)
        assert AbortMsg(request_id="waiting") in msgs and AbortMsg(request_id="streamed") in msgs
        gone = PeerGoneMsg(
            node_id="decode-1", addr=victim.info.addr, transfer_addr=victim.info.transfer_addr
        )
        assert gone in msgs
        again = [m for m in msgs if isinstance(m, PrefillReqMsg)]
        assert [(m.request_id, m.decode_node) for m in again] == [("waiting~1", "decode-0")]
        # the one that streamed resumes on the survivor alone, from the output it has
        resumed = await survivor.recv_until(LocalReqMsg)
        assert (resumed.request_id, resumed.prompt_ids) == ("streamed~1", PROMPT)
        assert resumed.output_ids == [4, 5] and resumed.sampling == PARAMS
        survivor.tokens("streamed~1", [5, 6], offset=1)  # an overlap: only 6 is new
        survivor.tokens("streamed~1", [7], finished=True, offset=3)
        await h.wait_done("streamed")
        assert "streamed" not in h.errors and h.tokens_of("streamed") == [4, 5, 6, 7]
        assert h.outputs["streamed"][-1].finish_reason == "length"
        survivor.tokens("waiting~1", [8, 9], finished=True)
        await h.wait_done("waiting")
        assert h.tokens_of("waiting") == [8, 9] and "waiting" not in h.errors
        stats = h.client.stats()
        assert h.client.flights.num_rerouted == 1 and stats.num_failed_nodes == 1
        assert stats.num_failovers == 1


async def test_a_started_request_fails_over_at_most_max_failovers_times() -> None:
    async with _harness(max_failovers=2) as h:
        h.add("prefill-0")
        nodes = [h.add(f"decode-{i}", slots=1000 - i) for i in range(3)]
        h.request("r")
        nodes[0].tokens("r", [4])
        await _until(lambda: h.tokens_of("r") == [4])
        for i in range(2):  # each death resumes it on the next node, with what it streamed
            h.client.membership.fail_node(nodes[i].node_id, "killed by the test")
            resumed = await nodes[i + 1].recv_until(LocalReqMsg)
            assert resumed.request_id == f"r~{i + 1}" and resumed.output_ids == [
                4,
                *range(5, 5 + i),
            ]
            nodes[i + 1].tokens(resumed.request_id, [5 + i], offset=1 + i)
            await _until(lambda i=i: len(h.tokens_of("r")) == 2 + i)
        h.client.membership.fail_node(nodes[2].node_id, "killed by the test")
        await h.wait_done("r")
        assert h.tokens_of("r") == [4, 5, 6]  # no token repeated, none missing
        assert isinstance(h.errors["r"], ClusterError)
        assert (
            "node decode-2 failed: killed by the test (failed over 2 time(s) before: no more)"
            in str(h.errors["r"])
        )
        metrics = ServerMetrics()
        metrics.update_stats(h.client.stats())
        assert "pd_server_failovers 2.0" in metrics.render().decode()


async def test_a_decode_node_removed_past_its_drain_deadline_fails_its_streams_over() -> None:
    async with _harness() as h:
        h.add("prefill-0")
        leaving, other = h.add("decode-0", slots=1000), h.add("decode-1", slots=100)
        h.request("r")
        leaving.tokens("r", [4, 5, 6])
        await _until(lambda: h.tokens_of("r") == [4, 5, 6])
        h.client.membership.drain_node("decode-0")
        h.client.membership.unregister_node("decode-0")  # its drain's deadline passed
        resumed = await other.recv_until(LocalReqMsg)
        assert (resumed.request_id, resumed.output_ids) == ("r~1", [4, 5, 6])
        other.tokens("r~1", [7], finished=True, offset=3)
        await h.wait_done("r")
        assert h.tokens_of("r") == [4, 5, 6, 7] and "r" not in h.errors


async def test_a_dead_prefill_node_reroutes_the_unstarted_and_leaves_decoding_alone() -> None:
    async with _harness() as h:
        p0, p1, d = h.add("prefill-0"), h.add("prefill-1"), h.add("decode-0")
        h.request("a")  # round robin: a on prefill-0, b on prefill-1
        assert (await p0.recv_until(PrefillReqMsg)).request_id == "a"
        h.request("b")
        assert (await p1.recv_until(PrefillReqMsg)).request_id == "b"
        d.tokens("a", [1])  # a decodes on the decode node: its prefill node no longer matters
        await _until(lambda: h.tokens_of("a") == [1])
        h.client.membership.fail_node("prefill-0", "gone")
        h.client.membership.fail_node(
            "prefill-1", "gone"
        )  # b streamed nothing: re-routed, it waits
        h.request("c")  # arrives while the prefill pool is empty: waits behind b
        await _until(lambda: h.client.stats().num_queued == 2)
        p2 = h.add("prefill-2")  # the replacement joins: the waiting requests go there, FIFO
        first = await p2.recv_until(PrefillReqMsg)
        second = await p2.recv_until(PrefillReqMsg)
        assert [first.request_id, second.request_id] == ["b~1", "c"]
        msgs = await _drain(d)
        assert AbortMsg(request_id="b") in msgs and AbortMsg(request_id="a") not in msgs
        assert [m.node_id for m in msgs if isinstance(m, PeerGoneMsg)] == ["prefill-0", "prefill-1"]
        d.tokens("a", [2], finished=True)
        d.tokens("b~1", [3], finished=True)
        d.tokens("c", [4], finished=True)
        for rid in ("a", "b", "c"):
            await h.wait_done(rid)
        assert not h.errors, h.errors
        assert [h.tokens_of(r) for r in ("a", "b", "c")] == [[1, 2], [3], [4]]


async def test_a_request_is_rerouted_only_once() -> None:
    async with _harness() as h:
        p0, d = h.add("prefill-0"), h.add("decode-0")
        h.request("r")
        await p0.recv_until(PrefillReqMsg)
        h.client.membership.fail_node("prefill-0", "first death")
        p1 = h.add("prefill-1")
        assert (await p1.recv_until(PrefillReqMsg)).request_id == "r~1"
        h.client.membership.fail_node("prefill-1", "second death")
        await h.wait_done("r")
        assert "node prefill-1 failed: second death (re-routed 1 time(s) before: no more)" in str(
            h.errors["r"]
        )
        assert d.node_id in h.client.membership.nodes


async def test_a_silent_node_is_dead_after_the_heartbeat_timeout() -> None:
    failed: list[str] = []
    async with _harness(heartbeat_timeout_s=0.5) as h:
        h.client.membership._on_node_failed = failed.append
        p, d = h.add("prefill-0"), h.add("decode-0")
        loop = asyncio.get_running_loop()
        start = loop.time()
        while loop.time() - start < 1.5:  # the prefill node beats, the decode node is silent
            p.beat()
            await asyncio.sleep(0.05)
        assert failed == ["decode-0"]
        assert "no heartbeat for" in h.client.membership.dead_nodes["decode-0"]
        assert list(h.client.membership.nodes) == ["prefill-0"]
        assert (await p.recv_until(PeerGoneMsg)).node_id == "decode-0"
        d.beat()  # a late beat of the dead node changes nothing
        await asyncio.sleep(0.1)
        assert list(h.client.membership.nodes) == ["prefill-0"]


async def test_while_a_replacement_starts_the_cluster_is_ready_and_requests_wait() -> None:
    async with _harness() as h:
        h.add("prefill-0"), h.add("decode-0")
        await _until(lambda: h.client.sockets.is_reading)
        h.client.membership.fail_node("decode-0", "gone")
        assert not await h.client.is_ready()
        h.client.membership.begin_start("decode")
        assert await h.client.is_ready()
        h.request("r")
        await _until(lambda: h.client.stats().num_queued == 1)
        d1 = h.add("decode-1")
        h.client.membership.end_start("decode")
        assert (await d1.recv_until(DecodeReqMsg)).request_id == "r"
        d1.tokens("r", [1], finished=True)
        await h.wait_done("r")
        assert h.tokens_of("r") == [1] and await h.client.is_ready()


async def test_readiness_says_which_pool_has_no_live_node_while_its_replacement_starts() -> None:
    """GET /ready: unlike is_ready (GET /health), a starting node does not make a pool live."""
    async with _harness() as h:
        assert await h.client.readiness() is not None  # nothing read yet
        h.add("prefill-0")
        await _until(lambda: h.client.sockets.is_reading)
        assert await h.client.readiness() == "no live decode node"
        h.add("decode-0")
        assert await h.client.readiness() is None
        h.client.membership.fail_node("decode-0", "link down")
        h.client.membership.begin_start("decode")
        assert await h.client.is_ready()
        assert await h.client.readiness() == "no live decode node (1 starting)"
        h.add("decode-1")
        h.client.membership.end_start("decode")
        assert await h.client.readiness() is None
        h.client.membership.fail_node("prefill-0", "host killed")
        assert await h.client.readiness() == "no live prefill node"


async def test_without_a_prefill_pool_the_decode_node_alone_serves_and_warms() -> None:
    """``Coordinator.decode_only`` (the launcher's, for a prefill pool of 0): ready with a
    decode node alone, which gets every request and warm-up to prefill itself."""
    async with _harness() as h:
        h.client.membership.set_decode_only(True)
        d = h.add("decode-0")
        await _until(lambda: h.client.sockets.is_reading)
        assert await h.client.readiness() is None and await h.client.is_ready()
        h.request("r")
        assert (await d.recv_until(LocalReqMsg)).request_id == "r"
        d.tokens("r", [7], finished=True)
        await h.wait_done("r")
        assert h.tokens_of("r") == [7] and not h.errors
        warm = asyncio.ensure_future(h.client.warm("w", PROMPT))
        assert (await d.recv_until(LocalReqMsg)).request_id == "w"
        d.tokens("w", [1], finished=True)
        assert (await asyncio.wait_for(warm, 5)).node_id == "decode-0"
        h.client.membership.set_decode_only(False)  # a prefill pool again: it must have a node
        assert await h.client.readiness() == "no live prefill node"


async def test_abort_while_waiting_for_room_ends_the_request() -> None:
    async with _harness() as h:
        p, d = h.add("prefill-0"), h.add("decode-0", slots=60)  # room for one
        h.request("r1")
        await p.recv_until(PrefillReqMsg)
        h.request("r2")
        await _until(lambda: h.client.stats().num_queued == 1)
        await h.client.abort("r2")
        await h.wait_done("r2")
        assert [o.finish_reason for o in h.outputs["r2"]] == ["abort"]
        assert h.client.stats().num_queued == 0
        d.tokens("r1", [1], finished=True)
        await h.wait_done("r1")


async def test_the_autoscalers_ttft_leaves_out_the_wait_for_decode_room() -> None:
    """A request that waits a second for a decode node with room, then gets its first token at
    once: its TTFT sample (the prefill pool's signal) is short; growing the prefill pool would
    not have shortened that wait."""
    async with _harness() as h:
        p, d = h.add("prefill-0"), h.add("decode-0", slots=60)  # room for one
        h.request("r1")
        await p.recv_until(PrefillReqMsg)
        d.tokens("r1", [1])  # r1 decodes ...
        await _until(lambda: len(h.client.ttft._samples) == 1)
        h.request("r2")
        await _until(lambda: h.client.stats().num_queued == 1)
        await asyncio.sleep(1.0)  # ... while r2 waits for room
        d.tokens("r1", [2], finished=True)
        await h.wait_done("r1")
        assert (await p.recv_until(PrefillReqMsg)).request_id == "r2"
        d.tokens("r2", [1], finished=True)
        await h.wait_done("r2")
        assert len(h.client.ttft._samples) == 2
        assert h.client.ttft.quantile(1.0, since=0.0) < 0.5  # the slower of the two


async def test_a_failed_transfer_reroutes_a_request_that_streamed_nothing_once() -> None:
    async with _harness(retry_delay_s=0.1) as h:
        p, d = h.add("prefill-0"), h.add("decode-0")
        h.request("r")
        await p.recv_until(PrefillReqMsg)

        def transfer_failed(node: FakeNode, rid: str) -> None:
            why = f"KV transfer failed on {node.node_id}"
            node.fails(rid, why, can_retry=True)

        transfer_failed(p, "r")  # both sides report it: one retry
        transfer_failed(d, "r")
        assert await p.recv_until(AbortMsg) == AbortMsg(request_id="r")
        assert (await p.recv_until(PrefillReqMsg)).request_id == "r~1"
        assert h.client.flights.num_rerouted == 1
        transfer_failed(p, "r~1")  # no re-route is left
        await h.wait_done("r")
        assert "KV transfer failed on prefill-0 (re-routed 1 time(s) before: no more)" in str(
            h.errors["r"]
        )
        h.request("own-error")  # an error of the request itself is not retried
        await p.recv_until(PrefillReqMsg)
        p.fails("own-error", "sampling failed")
        await h.wait_done("own-error")
        assert str(h.errors["own-error"]).endswith("sampling failed")
        assert not isinstance(h.errors["own-error"], ValueError)  # the server's 500
        assert h.client.flights.num_rerouted == 1


async def test_a_silent_request_out_of_reroutes_is_tried_again_when_its_decode_node_dies() -> None:
    """A transfer to a frozen decode node times out (its one re-route goes to the same node,
    not yet found dead); when the node is found dead, the request is tried again elsewhere (a
    failover of one that streamed nothing), not failed."""
    async with _harness(retry_delay_s=0.1) as h:
        p = h.add("prefill-0")
        frozen, other = h.add("decode-0", slots=1000), h.add("decode-1", slots=100)
        h.request("r")
        assert (await p.recv_until(PrefillReqMsg)).decode_node == "decode-0"
        p.fails("r", "KV transfer failed: not acknowledged", can_retry=True)
        again = await p.recv_until(PrefillReqMsg)
        assert (again.request_id, again.decode_node) == ("r~1", "decode-0")
        h.client.membership.fail_node(frozen.node_id, "no heartbeat")
        last = await p.recv_until(PrefillReqMsg)
        assert (last.request_id, last.decode_node) == ("r~2", "decode-1")
        other.tokens("r~2", [3, 4], finished=True)
        await h.wait_done("r")
        assert h.tokens_of("r") == [3, 4] and "r" not in h.errors


async def test_a_request_a_node_refuses_for_its_grammar_raises_a_value_error() -> None:
    """A node's ``is_refused`` error (its grammar over the node's budget) is the request's own
    fault: its stream raises ``RequestRefused``, a ValueError, which the server answers with
    a 400 (``pd.server.state``); it is not re-routed, and its other node drops it."""
    async with _harness() as h:
        p, d = h.add("prefill-0"), h.add("decode-0")
        h.request("r")
        await p.recv_until(PrefillReqMsg)
        why = "the grammar did not compile within 5 s (--grammar-timeout-s)"
        p.fails("r", why, is_refused=True)
        await h.wait_done("r")
        assert isinstance(h.errors["r"], RequestRefused) and isinstance(h.errors["r"], ValueError)
        assert str(h.errors["r"]) == why
        assert await d.recv_until(AbortMsg) == AbortMsg(request_id="r")
        assert h.client.flights.num_rerouted == 0


async def test_membership_calls_from_another_thread_run_on_the_loop(monkeypatch) -> None:
    async with _harness() as h:
        threads: list[threading.Thread] = []
        real_add = h.client.coordinator.nodes.add_prefill

        def add_prefill(node_id: str) -> None:
            threads.append(threading.current_thread())
            real_add(node_id)

        monkeypatch.setattr(h.client.coordinator.nodes, "add_prefill", add_prefill)
        node = h.nodes["prefill-0"] = FakeNode(h.ctx, "prefill-0", h.client.pull_addr, 1000)
        await asyncio.to_thread(h.client.membership.register_node, node.info)
        assert threads == [threading.current_thread()]  # the loop's, not the caller's
        assert list(h.client.membership.nodes) == ["prefill-0"]
        assert await asyncio.to_thread(h.client.membership.num_routed_to, "prefill-0") == 0


def test_membership_calls_before_start_run_here_and_after_the_loop_stopped_raise() -> None:
    client = ClusterClient(Coordinator(CoordinatorConfig()), "tcp://127.0.0.1:*", secret=SECRET)
    client.membership.begin_start("decode")  # no loop yet: done at once, on this thread
    assert client.membership.num_starting("decode") == 1

    async def start_and_close() -> None:
        await client.start()
        await client.close()

    asyncio.run(start_and_close())
    with pytest.raises(RuntimeError, match="event loop has stopped"):
        client.membership.end_start("decode")
