"""The server's reader drops, counts and goes on past anything: frames that fail the seal and
authentic messages that do not decode or fail to apply."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq

from pd.cluster.client import ClusterClient
from pd.cluster.coordinator import Coordinator, CoordinatorConfig
from pd.core.messages import CacheEventMsg, NodeInfo
from tests.conftest import free_port, make_node_stats
from transfer.auth import Sealer, new_secret

pytestmark = pytest.mark.timeout(20)


async def _scenario() -> None:
    secret = new_secret()
    addr = f"tcp://127.0.0.1:{free_port()}"
    client = ClusterClient(
        Coordinator(CoordinatorConfig(local_prefill_tokens=-1)), addr, secret=secret
    )
    await client.start()
    client.register_node(
        NodeInfo(
            node_id="prefill-0",
            role="prefill",
            addr="tcp://127.0.0.1:1",
            transfer_addr="tcp://127.0.0.1:2",
            num_slots=64,
            max_model_len=64,
        )
    )
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(client.addr)
    sealer = Sealer(secret, client.addr)
    enc = msgspec.msgpack.encode
    try:
        push.send(b"not sealed")
        push.send(sealer.seal(b"\xc1 sealed, not msgpack"))
        bogus = CacheEventMsg(node_id="prefill-0", seq=0, kind="bogus", namespace="", tokens=[1])
        unknown = CacheEventMsg(node_id="decode-9", seq=0, kind="reset", namespace="", tokens=[])
        push.send(sealer.seal(enc(bogus)))  # raises
        push.send(sealer.seal(enc(unknown)))  # unknown
        push.send(sealer.seal(enc(make_node_stats("prefill-0", "prefill"))))
        for _ in range(500):
            if "prefill-0" in client.node_stats:
                break
            await asyncio.sleep(0.01)
        assert "prefill-0" in client.node_stats  # the reader is alive after all of them
        assert (client.num_rejected_msgs, client.num_bad_msgs) == (1, 2)
        stats = client.stats()
        assert (stats.num_rejected_msgs, stats.num_dropped_msgs) == (1, 2)
    finally:
        push.close(linger=0)
        ctx.term()
        await client.close()


def test_the_reader_survives_bad_frames_and_bad_messages() -> None:
    asyncio.run(_scenario())
