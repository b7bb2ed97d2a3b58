"""A live 1P+1D Ray cluster whose server binds every interface (``--host 0.0.0.0``): what it
advertises, and a process without the cluster secret sending to each of its sockets while a
streamed request is decoding."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import time
from typing import Any

import httpx
import pytest

from pd.core.messages import AbortMsg, CacheEventMsg
from pd.model.tokenizer import encode_prompt, load_tokenizer
from tests.cluster.conftest import LiveCluster, wait_idle_and_check
from tests.conftest import make_node_stats
from tests.hf_reference import hf_greedy
from tests.security.helpers import capture, random_frames, run_stranger, unsigned
from transfer.endpoint import parse_endpoint
from transfer.messages import TransferRequestMsg

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The three primary colors are"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def live_spec(smollm2_dir) -> dict[str, Any]:
    return dict(num_prefill=1, num_decode=1, host="0.0.0.0")


async def _stream(url: str, max_tokens: int, started: asyncio.Event) -> str:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}  # fmt: skip
    text = ""
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choices = json.loads(line[6:])["choices"]
                    text += choices[0]["text"] if choices else ""
                    started.set()
    return text


def _metric(url: str, name: str) -> float | None:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_routable_addresses_and_strangers_refused_while_a_request_streams(
    live: LiveCluster, smollm2_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = live.cluster.client  # type: ignore[attr-defined]
    assert client.pull_addr.startswith("tcp://0.0.0.0:")
    infos = {info.role: info for info in client.nodes.values()}
    advertised = [client.addr] + [a for i in infos.values() for a in (i.addr, i.transfer_addr)]
    assert {parse_endpoint(a)[0] for a in advertised} == {"127.0.0.1"}  # a local instance

    tokenizer = load_tokenizer(smollm2_dir)
    want = tokenizer.decode(
        hf_greedy(smollm2_dir, encode_prompt(tokenizer, PROMPT), 64), skip_special_tokens=True
    )
    captured = capture(monkeypatch)
    assert asyncio.run(_stream(live.url, 64, asyncio.Event())) == want  # before: the frames
    p, d = infos["prefill"], infos["decode"]
    listener = socket.create_server(("127.0.0.1", 0))
    forged = TransferRequestMsg(
        transfer_id="evil",
        num_tokens=2,
        store_host="127.0.0.1",
        store_port=listener.getsockname()[1],
        group_prefix="kvx/evil/0",
        backend="gloo",
        num_layers=30,
        elems_per_token=384,
        dtype="bf16",
    )
    reset = CacheEventMsg(node_id=p.node_id, seq=10**6, kind="reset", namespace="", tokens=[])
    abort = AbortMsg(request_id="x")
    plan = {
        client.addr: random_frames(3, seed=1)
        + [unsigned(reset), unsigned(make_node_stats(p.node_id, "prefill"))],
        p.addr: random_frames(2, seed=2) + [captured.first(p.addr)],  # replays a prefill
        d.addr: random_frames(2, seed=3) + [unsigned(abort), captured.first(d.addr)],
    }  # fmt: skip
    to_d_ctrl = random_frames(2, seed=4) + [unsigned(forged)]

    async def attack_while_streaming() -> str:
        started = asyncio.Event()
        stream = asyncio.create_task(_stream(live.url, 64, started))
        await asyncio.wait_for(started.wait(), 60)
        actions = [{"push": addr, "frames": frames} for addr, frames in plan.items()]
        await asyncio.to_thread(
            run_stranger, actions + [{"dealer": d.transfer_addr, "frames": to_d_ctrl}]
        )
        return await stream

    try:
        assert asyncio.run(attack_while_streaming()) == want
        want_nodes = {p.node_id: len(plan[p.addr]), d.node_id: len(plan[d.addr]) + len(to_d_ctrl)}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            got = {n: client.node_stats[n].num_rejected_msgs for n in want_nodes}
            if got == want_nodes:
                break
            time.sleep(0.1)
        assert got == want_nodes
        assert _metric(live.url, "pd_server_rejected_messages") == len(plan[client.addr])
        assert _metric(live.url, "pd_server_dropped_messages") == 0
        assert not select.select([listener], [], [], 0.5)[0]  # the forged request dialled nothing
    finally:
        listener.close()
    wait_idle_and_check(live)
