"""A process without the cluster secret sends to every socket of a running cluster (the
server's PULL, each node's PULL and transfer ROUTER) while requests are in flight; and floods
the nodes' inboxes faster than they can read, while they serve a request.

The cluster is the real ``ClusterClient`` and a ``Node`` + ``Node`` on their own
loop threads, in this process, over the fake transfer backend and a tiny model (no Ray). The
decode node is held mid-decode while the stranger sends, so every request is in flight then.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from decode.node import DecodeRole
from pd.cluster.client import ClusterClient
from pd.core.messages import (
    AbortMsg,
    CacheEventMsg,
    PrefilledMsg,
    TokenMsg,
)
from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from pd.node import Node, NodeConfig
from pd.router.coordinator import Coordinator
from pd.router.policy import CoordinatorConfig
from pd.server.metrics import ServerMetrics
from prefill.node import PrefillRole
from tests.conftest import free_port, make_node_stats
from tests.security.helpers import capture, random_frames, run_stranger, unsigned
from transfer.auth import new_secret
from transfer.messages import TransferReadyMsg, TransferRequestMsg
from transfer.state import TransferConfig

pytestmark = pytest.mark.timeout(120)

SECRET = new_secret()
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [[5 + i, 17, 300 + i, 42, 9, 1000 + 7 * i, 77] * 3 for i in range(3)]


class DecodeGate:
    """Holds the decode node's forward passes while ``closed`` (requests stay in flight)."""

    def __init__(self, node: Node) -> None:
        self.closed = False
        self.is_held = threading.Event()
        self._open = threading.Event()
        run = node.core.runner.run

        def gated_run(*args: Any) -> Any:
            if self.closed:
                self.is_held.set()
                self._open.wait(60)
            return run(*args)

        node.core.runner.run = gated_run  # type: ignore[method-assign]

    def open(self) -> None:
        self.closed = False
        self._open.set()


def _prefill_req_with_bad_addr(rid: str, prompt: list[int]) -> str:
    """What ``PrefillReqMsg`` refuses to build: a transfer address no one can dial."""
    sampling = {"max_tokens": 4, "temperature": 0.0}
    return unsigned(
        {"type": "prefill_req", "request_id": rid, "prompt_ids": prompt, "sampling": sampling,
         "namespace": "", "decode_node": "decode-0", "decode_addr": "tcp://127.0.0.1:1",
         "decode_transfer_addr": "tcp://0.0.0.0:0"}
    )  # fmt: skip


async def _wait(pred: Any, timeout_s: float, what: str) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def engine_cfg(tiny_llama_dir) -> EngineConfig:
    return EngineConfig(model=str(tiny_llama_dir), max_total_tokens=512, page_size=4)


def test_hostile_frames_reach_no_handler_and_requests_in_flight_finish(
    engine_cfg: EngineConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = [r.token_ids for r in Engine(engine_cfg).generate(PROMPTS, GREEDY)]
    asyncio.run(_scenario(engine_cfg, reference, capture(monkeypatch)))


async def _scenario(engine_cfg: EngineConfig, reference: list[list[int]], captured: Any) -> None:
    client = ClusterClient(
        Coordinator(CoordinatorConfig(page_size=4, local_prefill_tokens=-1)),
        f"tcp://127.0.0.1:{free_port()}",
        secret=SECRET,
    )
    await client.start()
    fake = TransferConfig(backend="fake", timeout_s=30.0, handshake_timeout_s=30.0, secret=SECRET)
    p = Node(engine_cfg, NodeConfig("prefill-0", client.addr, transfer=fake), PrefillRole)
    d = Node(engine_cfg, NodeConfig("decode-0", client.addr, transfer=fake), DecodeRole)
    gate = DecodeGate(d)
    try:
        client.membership.register_node(p.start())
        client.membership.register_node(d.start())
        outputs: dict[str, list[int]] = {}

        async def run(rid: str, prompt: list[int]) -> None:
            async for out in client.generate(rid, prompt, GREEDY):
                outputs.setdefault(rid, []).extend(out.new_token_ids)

        tasks = [asyncio.create_task(run(f"r{i}", pr)) for i, pr in enumerate(PROMPTS)]
        await _wait(lambda: all(len(outputs.get(f"r{i}", [])) >= 2 for i in range(3)), 60,
                    "every request decoding")  # fmt: skip
        gate.closed = True
        await _wait(gate.is_held.is_set, 30, "the decode node held mid-request")

        p_ctrl, d_ctrl = p.transfer.endpoint, d.transfer.endpoint
        early_end = TokenMsg(
            request_id="r0",
            offset=1,
            token_ids=[7],
            finished=True,
            finish_reason="stop",
            num_prompt_tokens=21,
            num_cached_tokens=0,
        )
        reset = CacheEventMsg(node_id="prefill-0", seq=10**6, kind="reset", namespace="", tokens=[])
        forged_request = TransferRequestMsg(
            transfer_id="r0",
            num_tokens=3,
            group_prefix="kvx/x/0",
            backend="fake",
            num_layers=3,
            elems_per_token=1,
            dtype="f",
        )
        plan = {
            client.addr: random_frames(3, seed=1)
            + [
                unsigned(early_end),  # would end r0 early
                unsigned(reset),
                unsigned(make_node_stats("prefill-0", "prefill")),
                captured.first(client.addr),  # a node's real frame, replayed
            ],
            p.addr: random_frames(2, seed=2)
            + [
                _prefill_req_with_bad_addr("evil", PROMPTS[0]),
                unsigned(AbortMsg(request_id="r0")),
                captured.first(p.addr),  # the server's PrefillReqMsg of r0, replayed
            ],
            d.addr: random_frames(2, seed=3)
            + [
                unsigned(AbortMsg(request_id="r1")),
                unsigned(PrefilledMsg(request_id="r2", first_token=5, num_cached_tokens=0)),
                captured.first(d.addr),  # the server's DecodeReqMsg of r0, replayed
                captured.first(p.addr),  # sealed for the prefill node: not for this socket
            ],
        }
        ctrl_plan = {
            d_ctrl: random_frames(2, seed=4)
            + [
                unsigned(forged_request),
                captured.first(d_ctrl),  # the prefill node's TransferRequestMsg, replayed
            ],
            p_ctrl: random_frames(2, seed=5)
            + [
                unsigned(TransferReadyMsg(transfer_id="r0", slots=[1, 2, 3])),
                captured.first_reply(d_ctrl),  # a reply of d's, sent to p's ROUTER
            ],
        }
        actions = [{"push": a, "frames": f} for a, f in plan.items()]
        actions += [{"dealer": a, "frames": f} for a, f in ctrl_plan.items()]
        await asyncio.to_thread(run_stranger, actions)

        await _wait(lambda: client.num_rejected_msgs == len(plan[client.addr]), 30, "the server")
        await _wait(lambda: p.inbox.drops.total == len(plan[p.addr]), 30, "the prefill node")
        gate.open()
        want_d = len(plan[d.addr]) + len(ctrl_plan[d_ctrl])
        await _wait(lambda: d.heartbeat.num_rejected_msgs == want_d, 30, "the decode node")
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        # a prefill node reads its transfer socket only while it sends: one more request
        await asyncio.wait_for(run("after", PROMPTS[0]), 60)
        want_p = len(plan[p.addr]) + len(ctrl_plan[p_ctrl])
        await _wait(
            lambda: p.heartbeat.num_rejected_msgs == want_p, 30, "the prefill node's transfer port"
        )

        assert [outputs[f"r{i}"] for i in range(3)] + [outputs["after"]] == reference + [
            reference[0]
        ]
        # refused at the seal: none decoded, none applied
        nodes_rejected = (p.heartbeat.num_rejected_msgs, d.heartbeat.num_rejected_msgs)
        assert (client.num_rejected_msgs, *nodes_rejected) == (7, want_p, want_d)
        assert client.sockets._opener.drops.num_replayed == 1
        assert p.inbox.drops.num_replayed == 1 and d.inbox.drops.num_replayed == 1
        assert client.sockets.num_bad_msgs == p.inbox.num_bad_msgs == d.inbox.num_bad_msgs == 0
        assert p.transfer.num_dropped_msgs == d.transfer.num_dropped_msgs == 0
        assert client.coordinator.index("prefill-0").num_cached_tokens > 0  # no forged reset
        await _wait(lambda: client.membership.node_stats["decode-0"].num_rejected_msgs == want_d, 10,
                    "the decode node's stats")  # fmt: skip
        await _wait(lambda: client.membership.node_stats["prefill-0"].num_rejected_msgs == want_p, 10,
                    "the prefill node's stats")  # fmt: skip
        metrics = ServerMetrics()
        metrics.update_stats(client.stats())
        text = metrics.render().decode()
        assert "pd_server_rejected_messages 7.0" in text
        assert f'pd_node_rejected_messages{{node="decode-0"}} {float(want_d)}' in text
        by_peer = (
            f'pd_rejected_messages_by_peer{{peer="127.0.0.1",receiver="decode-0"}} {float(want_d)}'
        )
        assert by_peer in text
        for node in (p, d):
            report = node.check_integrity()
            assert report["unfinished"] == 0 and report["in_use"] == 0, (node.node_id, report)
    finally:
        gate.open()
        await client.close()
        p.shutdown()
        d.shutdown()


@pytest.mark.slow
def test_nodes_under_a_flood_still_step_and_beat(engine_cfg: EngineConfig) -> None:
    reference = Engine(engine_cfg).generate(PROMPTS[:1], GREEDY)[0].token_ids
    asyncio.run(_flood_scenario(engine_cfg, reference))


async def _flood_scenario(engine_cfg: EngineConfig, reference: list[int]) -> None:
    client = ClusterClient(
        Coordinator(CoordinatorConfig(page_size=4, local_prefill_tokens=-1)),
        f"tcp://127.0.0.1:{free_port()}",
        secret=SECRET,
    )
    await client.start()
    fake = TransferConfig(backend="fake", secret=SECRET)
    p = Node(engine_cfg, NodeConfig("prefill-0", client.addr, transfer=fake), PrefillRole)
    d = Node(engine_cfg, NodeConfig("decode-0", client.addr, transfer=fake), DecodeRole)
    for node in (p, d):  # each frame costs ~30 us, so the flood outruns the loop's reading
        node.inbox._opener.open = _slow(node.inbox._opener.open)  # type: ignore[method-assign]
    try:
        client.membership.register_node(p.start())
        client.membership.register_node(d.start())
        junk = random_frames(32, seed=23)
        flood = [{"to": n.addr, "kind": "push", "frames": junk, "connections": 4} for n in (p, d)]
        stranger = asyncio.create_task(
            asyncio.to_thread(run_stranger, [{"flood": flood, "seconds": 4.0, "linger_s": 0}])
        )
        silence = dict.fromkeys(("prefill-0", "decode-0"), 0.0)

        async def watch() -> None:  # how long the server goes without a node's heartbeat
            while True:
                now = time.monotonic()
                for n, heard in client.membership.liveness._last_heard.items():
                    silence[n] = max(silence[n], now - heard)
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(1.0)  # the flood is on
        out: list[int] = []

        async def request() -> None:
            async for o in client.generate("r", PROMPTS[0], GREEDY):
                out.extend(o.new_token_ids)

        await asyncio.wait_for(request(), 20)
        (result,) = await stranger
        watcher.cancel()
        assert out == reference
        assert client.membership.dead_nodes == {}
        # stats every 0.2 s, flood or not: silent for under a quarter of the heartbeat timeout
        # (make test runs another file beside this one: 1.4 s was seen under that load alone)
        assert max(silence.values()) < client.cfg.heartbeat_timeout_s / 4, silence
        sent = result["num_sent"]
        assert p.inbox.num_rejected_msgs > 10_000 and d.inbox.num_rejected_msgs > 10_000, sent
    finally:
        await client.close()
        p.shutdown()
        d.shutdown()


def _slow(open_: Any) -> Any:
    def slow_open(frame: Any) -> bytes | None:
        end = time.perf_counter() + 30e-6
        while time.perf_counter() < end:
            pass
        return open_(frame)

    return slow_open
