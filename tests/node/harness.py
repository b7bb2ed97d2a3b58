"""In-process node harness: the server's sockets (a PULL for what nodes send, PUSHes to nodes)
and helpers that drive a Node and a Node one loop iteration at a time."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from pd.core.messages import (
    CacheEventMsg,
    DecodeReqMsg,
    NodeStatsMsg,
    PrefillReqMsg,
    ServerMsg,
    TokenLogprobsMsg,
    TokenMsg,
)
from pd.core.sampling_params import SamplingParams
from pd.node import Node
from transfer.auth import Opener, Sealer, new_secret

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5 + i, 17, 300 + i, 42, 9, 1000 + 7 * i, 77] * 3 for i in range(3)]
SECRET = new_secret()  # the nodes' TransferConfig must carry it too (``secret=SECRET``)


@dataclass
class Server:
    """The server's side of the sockets: a PULL for what nodes send, PUSHes to nodes; every
    frame sealed under ``SECRET``, as the ``ClusterClient`` does."""

    ctx: zmq.Context[Any]
    pull: zmq.Socket[Any]
    addr: str
    push: dict[str, tuple[zmq.Socket[Any], Sealer]] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobsMsg]] = field(default_factory=dict)
    finished: dict[str, TokenMsg] = field(default_factory=dict)
    events: list[CacheEventMsg] = field(default_factory=list)
    stats: dict[str, NodeStatsMsg] = field(default_factory=dict)
    senders: dict[str, list[str]] = field(default_factory=dict)  # TokenMsg node ids
    num_stats: int = 0

    def __post_init__(self) -> None:
        self.opener = Opener(SECRET, self.addr)

    def send(self, node: Node, msg: Any) -> None:
        self.send_raw(node, msgspec.msgpack.encode(msg))

    def send_raw(self, node: Node, payload: bytes) -> None:
        """A sealed (authentic) frame around ``payload``, whatever it holds."""
        if node.addr not in self.push:
            sock = self.ctx.socket(zmq.PUSH)
            sock.connect(node.addr)
            self.push[node.addr] = (sock, Sealer(SECRET, node.addr))
        sock, sealer = self.push[node.addr]
        sock.send(sealer.seal(payload))

    def close(self) -> None:
        for sock, _ in self.push.values():
            sock.close(linger=0)
        self.push.clear()

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
                self.logprobs.setdefault(msg.request_id, []).extend(msg.logprobs)
                self.senders.setdefault(msg.request_id, []).append(msg.node_id)
                if msg.finished:
                    self.finished[msg.request_id] = msg
            elif isinstance(msg, CacheEventMsg):
                self.events.append(msg)
            else:
                self.stats[msg.node_id] = msg
                self.num_stats += 1


def send_request(server: Server, p: Node, d: Node, rid: str, prompt: list[int],
                  params: SamplingParams = GREEDY) -> None:  # fmt: skip
    server.send(
        d,
        DecodeReqMsg(
            request_id=rid, prompt_ids=prompt, sampling=params, namespace="", prefill_node=p.node_id
        ),
    )
    info = d.info()
    server.send(
        p,
        PrefillReqMsg(
            request_id=rid,
            prompt_ids=prompt,
            sampling=params,
            namespace="",
            decode_node=d.node_id,
            decode_addr=info.addr,
            decode_transfer_addr=info.transfer_addr,
        ),
    )


def run_until(server: Server, nodes: tuple[Node, ...], done: Any, max_iters: int = 20000) -> None:
    """Drive the nodes until ``done()``: at most ``max_iters`` iterations that did work, and at
    most 20 s; an idle iteration yields the CPU a moment to the pair workers' threads."""
    deadline = time.monotonic() + 20.0
    busy_iters = 0
    while busy_iters < max_iters and time.monotonic() < deadline:
        busy = [node.run_once(block=False) for node in nodes]
        server.drain()
        if done():
            return
        if any(busy):
            busy_iters += 1
        else:
            time.sleep(0.0005)
    raise AssertionError(f"not done after {busy_iters} busy iterations: {server.finished}")


def assert_idle(*nodes: Node) -> None:
    for node in nodes:
        report = node.integrity()
        assert report["unfinished"] == 0 and report["in_use"] == 0, (node.node_id, report)
