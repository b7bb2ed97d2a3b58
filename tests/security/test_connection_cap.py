"""Strangers' connections against each internal socket that binds (the server's PULL, a node's
inbox, a node's transfer port): 64 connections from another process, each sending frames just
under the socket's size limit, while the socket is not read. What the receiving process holds
stays under the cap's bound (``conn_cap.max_queued_bytes``), however many connections come; a
member connected before them keeps getting through."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import zmq

from pd.cluster.sockets import NodeSockets
from pd.node.links import Inbox
from tests.security.helpers import run_stranger
from transfer.auth import Sealer, new_secret
from transfer.conn_cap import MAX_CONNS, RCVHWM_FRAMES
from transfer.control import ControlPlane
from transfer.inbound import DEFAULT_MAX_TOKENS, SealedReader, max_frame_bytes

pytestmark = pytest.mark.timeout(60)

SECRET = new_secret()
MIB = 1 << 20
NUM_CONNS = 64
SMALL_LIMIT = 256 << 10  # the inbox's and transfer port's limit here: a test-sized frame
# What the receiver may hold beyond the cap's queues: connections over the cap in the moment
# before they are cut (they reconnect every 100 ms; a few at a time), and the allocator's slack
# (freed frames it keeps: a quiet whole-suite run saw the inbox at 41 MiB against 38 with 8 MiB
# of slack). Uncapped, the inbox would hold 128 MiB.
NUM_CUT_IN_FLIGHT = 8
SLACK = 16 * MIB


class Receiver(NamedTuple):
    addr: str  # where the strangers connect
    kind: str  # the stranger's socket: push | dealer
    frame_limit: int
    reader: SealedReader  # the socket's own
    audience: str  # what a member seals for
    close: Callable[[], None]


def _inbox(ctx: zmq.Context[Any]) -> Receiver:
    inbox = Inbox(ctx, "127.0.0.1", "127.0.0.1", SECRET, 30.0, "n0", SMALL_LIMIT)
    return Receiver(inbox.addr, "push", SMALL_LIMIT, inbox._reader, inbox.addr, inbox.close)


def _server(ctx: zmq.Context[Any]) -> Receiver:
    sockets = NodeSockets(30.0, lambda msg: None)
    audience = "tcp://server.test:1"  # what nodes would be told (any port binds here)
    sockets.bind("tcp://127.0.0.1:*", audience, SECRET, 4096)
    assert sockets._reader is not None and sockets._pull is not None
    addr = sockets._pull.last_endpoint.decode()
    limit = max_frame_bytes(DEFAULT_MAX_TOKENS)  # the server's: it cannot know its nodes'
    return Receiver(addr, "push", limit, sockets._reader, audience, sockets.close)


def _transfer(ctx: zmq.Context[Any]) -> Receiver:
    plane = ControlPlane(SECRET, max_frame_size=SMALL_LIMIT)
    ep = plane.endpoint
    return Receiver(ep, "dealer", SMALL_LIMIT, plane._reader, ep, plane.close)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    yield ctx
    ctx.destroy(linger=0)


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize(
    ("make", "frames_each"),
    [(_inbox, 8), (_server, 4), (_transfer, 8)],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_64_stranger_connections_hold_at_most_the_caps_bound(
    ctx: zmq.Context[Any], make: Callable[[zmq.Context[Any]], Receiver], frames_each: int
) -> None:
    recv = make(ctx)
    try:
        # a member, connected before the strangers
        member = ctx.socket(zmq.PUSH if recv.kind == "push" else zmq.DEALER)
        member.connect(recv.addr)
        sealer = Sealer(SECRET, recv.audience)
        member.send(sealer.seal(b"first"))
        assert _read_until(recv.reader, b"first", 5.0)

        frame = recv.frame_limit - 1  # just under the limit: libzmq queues it
        before = _rss_bytes()
        flood = {"to": recv.addr, "kind": recv.kind, "frames": [], "zeros": [frame]}
        action = {
            "flood": [{**flood, "connections": NUM_CONNS}],
            "seconds": 20,
            "max_frames": NUM_CONNS * frames_each,
            "hold_s": 2.0,  # the connections stay open, the socket unread
            "linger_s": 0,
        }
        result: list[dict[str, Any]] = []
        stranger = threading.Thread(target=lambda: result.extend(run_stranger([action])))
        stranger.start()
        peak = 0
        while stranger.is_alive():
            peak = max(peak, _rss_bytes() - before)
            time.sleep(0.01)
        stranger.join()
        assert result[0]["num_sent"] == [NUM_CONNS * frames_each]

        # the cap's bound: MAX_CONNS connections' queues, whatever the strangers opened
        bound = (MAX_CONNS + NUM_CUT_IN_FLIGHT) * (RCVHWM_FRAMES + 1) * recv.frame_limit + SLACK
        unbounded = NUM_CONNS * frames_each * frame  # what libzmq would queue uncapped
        print(
            f"\n{make.__name__}: {NUM_CONNS} connections x {frames_each} frames of "
            f"{frame / MIB:.2f} MiB ({unbounded / MIB:.0f} MiB sent): the receiver's RSS "
            f"grew {peak / MIB:.0f} MiB at most; bound {bound / MIB:.0f} MiB"
        )
        assert peak < bound, f"RSS grew {peak / MIB:.0f} MiB, over the bound {bound / MIB:.0f}"

        # the member's connection was never cut: its next frame gets through
        member.send(sealer.seal(b"after"))
        assert _read_until(recv.reader, b"after", 10.0)
        member.close(linger=0)
    finally:
        recv.close()


def _read_until(reader: SealedReader, payload: bytes, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if any(got.payload == payload for got in reader.read()):
            return True
        time.sleep(0.005)
    return False


def test_a_cluster_the_cap_cannot_hold_is_refused_with_the_numbers() -> None:
    from pd.fleet.config import ClusterConfig
    from transfer.state import TransferConfig

    with pytest.raises(ValueError, match="32 nodes need transfer max_conns > 32 .* got 32"):
        ClusterConfig(num_prefill=16, num_decode=16)
    ClusterConfig(num_prefill=16, num_decode=16, transfer=TransferConfig(max_conns=33))
    with pytest.raises(ValueError, match="max_conns must be >= 2"):
        TransferConfig(max_conns=1)
