"""A PrefillNode and a DecodeNode in this process, over the fake transfer backend and a tiny
random model, driven one loop iteration at a time: no Ray, no sleeps."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import zmq

from decode.node import DecodeNode
from pd.config import EngineConfig
from pd.engine.engine import Engine
from pd.messages import (
    AbortMsg,
    CacheEventMsg,
    DecodeReqMsg,
    LocalReqMsg,
    NodeStatsMsg,
    PrefillReqMsg,
    ServerMsg,
    TokenMsg,
)
from pd.node import BaseNode, NodeConfig
from pd.sampling_params import SamplingParams
from prefill.node import PrefillNode
from transfer import TransferConfig
from transfer.auth import Opener, Sealer, new_secret

pytestmark = pytest.mark.timeout(90)  # fixtures load models; each test runs in ~0.1 s
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5 + i, 17, 300 + i, 42, 9, 1000 + 7 * i, 77] * 3 for i in range(3)]
SECRET = new_secret()


@dataclass
class Server:
    """The server's side of the sockets: a PULL for what nodes send, PUSHes to nodes; every
    frame sealed under ``SECRET``, as the ``ClusterClient`` does."""

    ctx: zmq.Context[Any]
    pull: zmq.Socket[Any]
    addr: str
    push: dict[str, tuple[zmq.Socket[Any], Sealer]] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, TokenMsg] = field(default_factory=dict)
    events: list[CacheEventMsg] = field(default_factory=list)
    stats: dict[str, NodeStatsMsg] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.opener = Opener(SECRET, self.addr)

    def send(self, node: BaseNode, msg: Any) -> None:
        self.send_raw(node, msgspec.msgpack.encode(msg))

    def send_raw(self, node: BaseNode, payload: bytes) -> None:
        if node.addr not in self.push:
            sock = self.ctx.socket(zmq.PUSH)
            sock.connect(node.addr)
            self.push[node.addr] = (sock, Sealer(SECRET, node.addr))
        sock, sealer = self.push[node.addr]
        sock.send(sealer.seal(payload))

    def drain(self) -> None:
        decoder = msgspec.msgpack.Decoder(ServerMsg)
        while True:
            try:
                raw = self.opener.open(self.pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            assert raw is not None, self.opener.drops
            msg = decoder.decode(raw)
            if isinstance(msg, TokenMsg):
                self.tokens.setdefault(msg.request_id, []).extend(msg.token_ids)
                if msg.finished:
                    self.finished[msg.request_id] = msg
            elif isinstance(msg, CacheEventMsg):
                self.events.append(msg)
            else:
                self.stats[msg.node_id] = msg


@pytest.fixture(scope="module")
def engine_cfg(tiny_llama_dir) -> EngineConfig:
    return EngineConfig(model=str(tiny_llama_dir), max_total_tokens=512, page_size=4)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    ctx: zmq.Context[Any] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    yield Server(ctx, pull, f"tcp://127.0.0.1:{port}")
    pull.close(linger=0)
    ctx.term()


@pytest.fixture(scope="module")
def nodes(engine_cfg: EngineConfig, server: Server) -> Iterator[tuple[PrefillNode, DecodeNode]]:
    fake = TransferConfig(backend="fake", timeout_s=5.0, handshake_timeout_s=5.0, secret=SECRET)
    p = PrefillNode(engine_cfg, NodeConfig("prefill-0", server.addr, transfer=fake))
    d = DecodeNode(engine_cfg, NodeConfig("decode-0", server.addr, transfer=fake))
    yield p, d
    for sock, _ in server.push.values():
        sock.close(linger=0)
    server.push.clear()
    p.shutdown()
    d.shutdown()


@pytest.fixture(scope="module")
def reference(engine_cfg: EngineConfig) -> list[list[int]]:
    engine = Engine(engine_cfg)
    return [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]


def _send_request(server: Server, p: PrefillNode, d: DecodeNode, rid: str, prompt: list[int],
                  params: SamplingParams = GREEDY) -> None:  # fmt: skip
    server.send(d, DecodeReqMsg(rid, prompt, params, "", p.node_id))
    info = d.info()
    server.send(p, PrefillReqMsg(rid, prompt, params, "", d.node_id, info.addr, info.transfer_addr))


def _run_until(
    server: Server, nodes: tuple[BaseNode, ...], done: Any, max_iters: int = 20000
) -> None:
    for _ in range(max_iters):
        for node in nodes:
            node.run_once(block=False)
        server.drain()
        if done():
            return
    raise AssertionError(f"not done after {max_iters} iterations: {server.finished}")


def _assert_idle(*nodes: BaseNode) -> None:
    for node in nodes:
        report = node._check_integrity()
        assert report["unfinished"] == 0 and report["in_use"] == 0, (node.node_id, report)


def test_disaggregated_greedy_equals_the_colocated_engine(server, nodes, reference) -> None:
    p, d = nodes
    for i, prompt in enumerate(PROMPTS):
        _send_request(server, p, d, f"r{i}", prompt)
    _run_until(server, nodes, lambda: len(server.finished) >= len(PROMPTS))
    assert [server.tokens[f"r{i}"] for i in range(len(PROMPTS))] == reference
    assert all(m.finish_reason == "length" and m.error is None for m in server.finished.values())
    assert server.finished["r0"].num_prompt_tokens == len(PROMPTS[0])
    assert any(e.node_id == "prefill-0" and e.kind == "inserted" for e in server.events)
    assert {"prefill-0", "decode-0"} <= set(server.stats)  # each loop published its stats
    assert p.transfer_counters.num_done == len(PROMPTS)
    _assert_idle(p, d)


def test_a_request_done_at_its_first_token_frees_both_sides(server, nodes) -> None:
    p, d = nodes
    _send_request(server, p, d, "one", PROMPTS[0], SamplingParams(max_tokens=1, temperature=0))
    _run_until(server, nodes, lambda: "one" in server.finished)
    assert len(server.tokens["one"]) == 1
    _run_until(server, nodes, lambda: d._num_unfinished() == 0, max_iters=100)
    _assert_idle(p, d)


@pytest.mark.parametrize("when", ["before_prefill", "while_decoding"])
def test_abort_frees_both_nodes(server, nodes, when: str) -> None:
    p, d = nodes
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    rid = f"abort-{when}"
    _send_request(server, p, d, rid, PROMPTS[1], long)
    if when == "while_decoding":
        _run_until(server, nodes, lambda: len(server.tokens.get(rid, [])) >= 3)
    for node in nodes:
        server.send(node, AbortMsg(rid))
    _run_until(server, nodes, lambda: p._num_unfinished() == d._num_unfinished() == 0)
    _assert_idle(p, d)


def test_malformed_messages_are_counted_and_dropped(server, nodes) -> None:
    p, d = nodes
    before = p.num_bad_msgs
    server.send_raw(p, b"\x00garbage")  # authentic frames, malformed messages
    server.send_raw(p, msgspec.msgpack.encode({"type": "prefill_req", "request_id": 5}))
    _run_until(server, nodes, lambda: p.num_bad_msgs == before + 2, max_iters=2000)
    _send_request(server, p, d, "after-garbage", PROMPTS[2])
    _run_until(server, nodes, lambda: "after-garbage" in server.finished)
    assert server.finished["after-garbage"].error is None


def test_a_failed_forward_fails_its_batch_and_the_node_goes_on(server, nodes, monkeypatch) -> None:
    p, d = nodes
    runner = d.core.runner
    real_run = runner.run
    calls = {"n": 0}

    def flaky_run(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return real_run(*args)

    monkeypatch.setattr(runner, "run", flaky_run)
    _send_request(server, p, d, "victim", PROMPTS[0])
    _run_until(server, nodes, lambda: "victim" in server.finished)
    assert "forward failed: injected" in (server.finished["victim"].error or "")
    _send_request(server, p, d, "survivor", PROMPTS[0])
    _run_until(server, nodes, lambda: "survivor" in server.finished)
    assert server.finished["survivor"].error is None
    _assert_idle(p, d)


def test_a_decode_node_prefills_a_local_request_beside_transferred_ones(
    server, nodes, reference
) -> None:
    """Conditional disaggregation's node side: a LocalReqMsg is prefilled on the decode node,
    interleaved with requests whose KV came from the prefill node; all equal the reference."""
    p, d = nodes
    _send_request(server, p, d, "via-prefill-0", PROMPTS[0])
    server.send(d, LocalReqMsg("local-1", PROMPTS[1], GREEDY, ""))
    _send_request(server, p, d, "via-prefill-2", PROMPTS[2])
    names = ["via-prefill-0", "local-1", "via-prefill-2"]
    _run_until(server, nodes, lambda: all(n in server.finished for n in names))
    assert [server.tokens[n] for n in names] == reference
    assert server.finished["local-1"].num_prompt_tokens == len(PROMPTS[1])
    _assert_idle(p, d)
