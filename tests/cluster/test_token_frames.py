"""Token frames lost or duplicated between a node and the server, with real processes' parts:
the real ``ClusterClient`` and a prefill and a decode ``Node`` on their own loop threads in
this process (a tiny model, the fake transfer backend, real zmq sockets; no Ray). A test-only
wrapper around each node's ``ServerLink.send`` drops or repeats chosen ``TokenMsg`` frames, as
a full socket (``send`` drops on ``zmq.Again``) or a cut connection would: every answer is
whole and equal to the undisturbed one (greedy, with logprobs), or ends at once with an error
naming the lost tokens; none waits for its deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from decode.node import DecodeRole
from pd.cluster.client import ClusterClient
from pd.cluster.client_config import ClientConfig
from pd.cluster.flights import ClusterError
from pd.core.messages import TokenMsg
from pd.core.outputs import RequestOutput
from pd.core.sampling_params import SamplingParams
from pd.executor.config import EngineConfig
from pd.node import Node, NodeConfig
from pd.router.coordinator import Coordinator
from pd.router.policy import CoordinatorConfig
from prefill.node import PrefillRole
from tests.conftest import free_port
from transfer.auth import new_secret
from transfer.state import TransferConfig

pytestmark = pytest.mark.timeout(180)

SECRET = new_secret()
PROMPTS = [[5 + i, 17, 300 + i, 42, 9, 1000 + 7 * i, 77] * 3 for i in range(2)]
PARAMS = [
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
]
WAIT_S = 30.0  # far under the request deadline (600 s): an answer that waits for it fails


class Frames:
    """Wraps a node's ``ServerLink.send``: ``rule(request_id, index, msg)`` says how many times
    each of a request's token frames goes out (0: lost; index counts from 1)."""

    def __init__(self, node: Node) -> None:
        self.rule: Callable[[str, int, TokenMsg], int] = lambda rid, i, msg: 1
        self.sent: dict[str, list[TokenMsg]] = {}
        self.num_lost = self.num_repeated = 0
        self.raw = send = node.server.send  # the link's own

        def wrapped(msg: Any) -> None:
            if not isinstance(msg, TokenMsg):
                return send(msg)
            frames = self.sent.setdefault(msg.request_id, [])
            frames.append(msg)
            times = self.rule(msg.request_id, len(frames), msg)
            self.num_lost += times == 0
            self.num_repeated += max(times - 1, 0)
            for _ in range(times):
                send(msg)

        node.server.send = wrapped  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def engine_cfg(tiny_llama_dir) -> EngineConfig:
    return EngineConfig(model=str(tiny_llama_dir), max_total_tokens=512, page_size=4)


def test_lost_and_repeated_token_frames_leave_every_answer_whole(engine_cfg: EngineConfig) -> None:
    asyncio.run(_scenario(engine_cfg))


async def _answer(client: ClusterClient, rid: str, i: int) -> list[RequestOutput]:
    async def run() -> list[RequestOutput]:
        return [out async for out in client.generate(rid, PROMPTS[i], PARAMS[i])]

    return await asyncio.wait_for(run(), WAIT_S)


def _whole(outs: list[RequestOutput]) -> tuple[Any, ...]:
    """What a caller sees of an answer: its tokens, logprobs, end and usage."""
    tokens = [t for out in outs for t in out.new_token_ids]
    logprobs = [lp for out in outs for lp in out.logprobs]
    last = outs[-1]
    return tokens, logprobs, last.finished, last.finish_reason, last.num_prompt_tokens


async def _scenario(engine_cfg: EngineConfig) -> None:
    cfg = ClientConfig(token_probe_s=0.5, watch_interval_s=0.05)
    coordinator = Coordinator(CoordinatorConfig(page_size=4, local_prefill_tokens=-1))
    client = ClusterClient(coordinator, f"tcp://127.0.0.1:{free_port()}", cfg, secret=SECRET)
    await client.start()
    fake = TransferConfig(backend="fake", timeout_s=30.0, handshake_timeout_s=30.0, secret=SECRET)
    p = Node(engine_cfg, NodeConfig("prefill-0", client.addr, transfer=fake), PrefillRole)
    d = Node(engine_cfg, NodeConfig("decode-0", client.addr, transfer=fake), DecodeRole)
    p_frames, d_frames = Frames(p), Frames(d)
    try:
        client.membership.register_node(p.start())
        client.membership.register_node(d.start())
        want = [_whole(await _answer(client, f"ref-{i}", i)) for i in range(2)]
        assert [len(w[0]) for w in want] == [12, 12] and len(want[1][1]) == 12

        # the 2nd frame and the first last frame of each request are lost
        d_frames.rule = lambda rid, i, msg: 0 if i == 2 or (msg.finished and not _ended(
            d_frames, rid)) else 1  # fmt: skip
        got = await asyncio.gather(*(_answer(client, f"drop-{i}", i) for i in range(2)))
        assert [_whole(g) for g in got] == want
        assert d_frames.num_lost == 4

        # every frame twice, and the 2nd once more after the 4th (late, out of order)
        def repeat(rid: str, i: int, msg: TokenMsg) -> int:
            if i == 4:
                d_frames.raw(d_frames.sent[rid][1])
            return 2

        d_frames.rule = repeat
        got = await asyncio.gather(*(_answer(client, f"dup-{i}", i) for i in range(2)))
        assert [_whole(g) for g in got] == want
        assert client.flights.resends.num_duplicates >= 2 * 12

        # a request that ends at its first token: its prefill node answers it, and loses it
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        ref_one = [out async for out in client.generate("one-ref", PROMPTS[0], one)]
        d_frames.rule = lambda rid, i, msg: 1
        p_frames.rule = lambda rid, i, msg: 0 if i == 1 else 1
        got_one = [out async for out in client.generate("one-lost", PROMPTS[0], one)]
        assert _whole(got_one) == _whole(ref_one) and p_frames.num_lost == 1

        # the node no longer holds what was lost: a clear error, at once
        d.server.recent.max_ids = 0
        d_frames.rule = lambda rid, i, msg: 0 if msg.finished and msg.error is None else 1
        with pytest.raises(ClusterError, match="cannot send tokens from offset 11 of request"):
            await _answer(client, "gone-0", 0)
        assert client.stats().num_token_resends > 0 and client.stats().num_token_gaps > 0
        await asyncio.sleep(0.5)  # the failed request's abort reaches the nodes
        for node in (p, d):
            report = node.check_integrity()
            assert report["unfinished"] == 0 and report["in_use"] == 0, (node.node_id, report)
    finally:
        await client.close()
        p.shutdown()
        d.shutdown()


def _ended(frames: Frames, rid: str) -> bool:
    """A last frame of ``rid`` went out before the one just sent (the one just sent is last)."""
    return any(m.finished for m in frames.sent[rid][:-1])
