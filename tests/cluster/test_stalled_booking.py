"""A booking follows the work, not the client: the HTTP server over a ``ClusterClient`` whose
nodes are fakes (their sockets, driven by the test; no model, no Ray), and a client that never
reads its stream. The coordinator frees the decode booking when the node's finish is read, and
the server the admission place, while the stream is still blocked on the client; the write
timeout then cuts the stream."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import zmq.asyncio

from pd.cluster.client import ClusterClient
from pd.cluster.client_config import ClientConfig
from pd.core.messages import DecodeReqMsg, PrefillReqMsg
from pd.router.coordinator import Coordinator
from pd.router.policy import CoordinatorConfig
from pd.server import ServerConfig, build_app
from tests.cluster.test_client import SECRET, FakeNode
from tests.conftest import free_port
from tests.server.conftest import SCRIPT_TEXT, serve
from tests.server.raw_client import LONG_STREAM, SNDBUF, client_gone, stalled_streams

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
WRITE_TIMEOUT_S = 2.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_a_stalled_stream_holds_no_decode_booking_once_its_node_finished(
    smollm2_dir: Path,
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir), local_files_only=True)
    coordinator = Coordinator(CoordinatorConfig(policy="round_robin", local_prefill_tokens=-1))
    addr = f"tcp://127.0.0.1:{free_port()}"
    client = ClusterClient(coordinator, addr, ClientConfig(heartbeat_timeout_s=60), secret=SECRET)
    ctx = zmq.asyncio.Context()
    p = FakeNode(ctx, "prefill-0", addr, slots=1000)
    d = FakeNode(ctx, "decode-0", addr, slots=10_000)
    for node in (p, d):
        client.membership.register_node(node.info)  # before start(): on this thread
    app = build_app(
        client,
        tokenizer=tokenizer,
        model_name="m",
        max_model_len=4096,
        config=ServerConfig(stream_write_timeout_s=WRITE_TIMEOUT_S),
    )
    admission = app.state.server.admission
    ids = tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False) * 200
    try:
        with serve(app, sndbuf=SNDBUF) as url:
            async with httpx.AsyncClient(base_url=url, timeout=5) as http:
                # the client starts on the server's loop at the first /ready; it is ready
                # once its reader has read a frame
                while (await http.get("/ready")).status_code != 200:
                    p.beat()
                    d.beat()
                    await asyncio.sleep(0.05)
            (sock,) = stalled_streams(url, 1)
            wire = (await d.recv_until(DecodeReqMsg)).request_id
            assert (await p.recv_until(PrefillReqMsg)).request_id == wire
            assert wire in coordinator._requests  # booked on both nodes
            for token in ids[: LONG_STREAM["max_tokens"] - 1]:  # one message each, as nodes do
                d.tokens(wire, [token])
            d.tokens(wire, [ids[0]], finished=True)
            # freed when the reader reads the finish, though the stream is blocked on its client
            await _until(lambda: not coordinator._requests)
            coordinator.check_integrity()
            # its generation is over: its admission place comes back too, while the rest of
            # its answer waits in its pipe (held by the server's budget) for its client
            await _until(lambda: admission.num_inflight == 0)
            assert client_gone(app, "stalled") == 0, "freed only by the cut"
            held = app.state.server.stream_bytes
            assert held.num_streams == 1 and 0 < held.num_bytes <= held.max_bytes
            await _until(lambda: client_gone(app, "stalled") == 1, timeout_s=WRITE_TIMEOUT_S + 10)
            await _until(lambda: held.num_streams == 0 and held.num_bytes == 0)
            sock.close()
            assert client.loop is not None
            closing = asyncio.run_coroutine_threadsafe(client.close(), client.loop)
            await asyncio.wrap_future(closing)
    finally:
        for node in (p, d):
            node.close()
        ctx.term()
    metrics = app.state.server.metrics.render().decode()
    assert 'pd_requests_total{finish_reason="length"} 1.0' in metrics  # it generated it all
