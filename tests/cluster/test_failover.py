"""Failover of started requests, with real processes' parts: the real ``ClusterClient``, a
prefill node and two decode nodes on their own loop threads in this process (a tiny model, the
fake transfer backend, real zmq sockets; no Ray). Decode node 0 freezes mid-stream (its loop
thread stops inside a send, as a SIGSTOP would leave it) and is then found dead: every request
it held waits for decode node 1, its replacement, and goes on there, and each answer the caller sees (tokens, logprobs, the end
and usage) equals the undisturbed one, for everything a request can carry: greedy, seeded
sampling (two seeds: a request's ``n=2``), top-k/top-p, penalties, ``logit_bias`` with
``min_tokens``, a JSON schema's grammar greedy and sampled, logprobs; at the engine's defaults
and with speculative decoding. The same with real processes and signals:
``tests/cluster/test_faults.py``."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any

import pytest

from decode.node import DecodeRole
from pd.cluster.client import ClusterClient
from pd.cluster.client_config import ClientConfig
from pd.core.messages import TokenMsg
from pd.core.outputs import RequestOutput
from pd.core.sampling_params import SamplingParams
from pd.executor.config import EngineConfig
from pd.node import Node, NodeConfig
from pd.router.coordinator import Coordinator
from pd.router.policy import CoordinatorConfig
from prefill.node import PrefillRole
from tests.cluster.test_token_frames import _whole
from tests.conftest import free_port
from tests.engine.test_structured_engine import PERSON, POINT, _schema_grammar
from transfer.auth import new_secret
from transfer.state import TransferConfig

pytestmark = pytest.mark.timeout(300)

SECRET = new_secret()
N = 24
PARAMS = [
    SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=3),
    SamplingParams(max_tokens=N, temperature=0.9, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=N, temperature=0.9, seed=8, ignore_eos=True),  # n=2's 2nd choice
    SamplingParams(max_tokens=N, temperature=1.0, seed=3, top_k=50, top_p=0.9, logprobs=2),
    SamplingParams(
        max_tokens=N,
        temperature=0.8,
        seed=4,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        repetition_penalty=1.2,
    ),
    SamplingParams(max_tokens=N, temperature=0.0, min_tokens=20, logit_bias=((7, 3.0),)),
    SamplingParams(max_tokens=48, temperature=0.9, seed=5, grammar=_schema_grammar(POINT)),
    SamplingParams(max_tokens=48, temperature=0.0, grammar=_schema_grammar(PERSON), logprobs=1),
]
PROMPTS = [[5 + i, 17, 300 + i, 42, 9, 1000 + 7 * i, 77] * 3 for i in range(len(PARAMS))]
FREEZE_AT = 4  # decode node 0 freezes sending the first frame from this offset on
WAIT_S = 120.0  # far under the request deadline (600 s): an answer that waits for it fails


class Freezer:
    """Wraps decode node 0's ``ServerLink.send``: the first token frame at ``FREEZE_AT`` or
    later stops its loop thread there until ``thaw`` (frames after it are never sent)."""

    def __init__(self, node: Node) -> None:
        self.frozen = threading.Event()
        self._thaw = threading.Event()
        send = node.server.send

        def wrapped(msg: Any) -> None:
            if self.frozen.is_set():
                return  # a dead node sends nothing
            if isinstance(msg, TokenMsg) and msg.offset >= FREEZE_AT and msg.token_ids:
                self.frozen.set()
                self._thaw.wait(timeout=WAIT_S)
                return
            send(msg)

        node.server.send = wrapped  # type: ignore[method-assign]

    def thaw(self) -> None:
        self._thaw.set()


@pytest.fixture(scope="module", params=["defaults", "speculative"])
def engine_cfg(request, tiny_llama_dir) -> EngineConfig:
    cfg = EngineConfig(model=str(tiny_llama_dir), max_total_tokens=2048, page_size=4)
    if request.param == "speculative":
        # speculating in every step, however many requests it holds
        cfg = dataclasses.replace(cfg, speculative_tokens=4, speculative_max_batch=64)
    return cfg


def test_requests_on_a_frozen_then_dead_decode_node_complete_as_undisturbed(
    engine_cfg: EngineConfig,
) -> None:
    asyncio.run(_scenario(engine_cfg))


async def _answer(client: ClusterClient, rid: str, i: int) -> list[RequestOutput]:
    async def run() -> list[RequestOutput]:
        return [out async for out in client.generate(rid, PROMPTS[i], PARAMS[i])]

    return await asyncio.wait_for(run(), WAIT_S)


async def _scenario(engine_cfg: EngineConfig) -> None:
    cfg = ClientConfig(watch_interval_s=0.05)
    coordinator = Coordinator(CoordinatorConfig(page_size=4, local_prefill_tokens=-1))
    client = ClusterClient(coordinator, f"tcp://127.0.0.1:{free_port()}", cfg, secret=SECRET)
    await client.start()
    fake = TransferConfig(backend="fake", timeout_s=30.0, handshake_timeout_s=30.0, secret=SECRET)
    p = Node(engine_cfg, NodeConfig("prefill-0", client.addr, transfer=fake), PrefillRole)
    d0 = Node(engine_cfg, NodeConfig("decode-0", client.addr, transfer=fake), DecodeRole)
    d1 = Node(engine_cfg, NodeConfig("decode-1", client.addr, transfer=fake), DecodeRole)
    freezer: Freezer | None = None
    try:
        for node in (p, d0):
            client.membership.register_node(node.start())
        d1_info = d1.start()
        n = len(PARAMS)
        want = [_whole(await _answer(client, f"ref-{i}", i)) for i in range(n)]
        assert all(w[3] in ("length", "stop") for w in want), want

        freezer = Freezer(d0)
        answers = asyncio.gather(*(_answer(client, f"r-{i}", i) for i in range(n)))
        while not freezer.frozen.is_set():
            await asyncio.sleep(0.01)
        started = sum(f.num_received > 0 for f in client.flights._by_id.values())
        client.membership.fail_node("decode-0", "frozen by the test")
        # no decode node is left: the requests wait for its replacement, then resume there
        await asyncio.sleep(0.5)
        client.membership.register_node(d1_info)
        got = [_whole(g) for g in await answers]
        for i in range(n):
            assert got[i] == want[i], (i, PARAMS[i], got[i], want[i])
        assert started >= 1 and client.stats().num_failovers == started
        if engine_cfg.speculative_tokens:  # the resumed requests decoded speculatively there
            assert d1.call(lambda: d1.scheduler.stats().num_draft_tokens) > 0
        for node in (p, d1):
            report = node.check_integrity()
            assert report["unfinished"] == 0 and report["in_use"] == 0, (node.node_id, report)
    finally:
        if freezer is not None:
            freezer.thaw()
        await client.close()
        for node in (p, d0, d1):
            node.shutdown()
