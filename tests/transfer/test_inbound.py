"""Bounded reads of sealed frames: the size limit (frames over it are dropped unread), the
budget of one read, refusals counted per sending address, and the limit against the largest
legitimate messages."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from pd.core.messages import CacheEventMsg, PrefillReqMsg
from pd.core.sampling_params import MAX_INT32, MAX_SEED, SamplingParams
from tests.security.helpers import run_stranger
from transfer.auth import Opener, Sealer, new_secret
from transfer.inbound import (
    ReadBudget,
    RejectsByPeer,
    SealedReader,
    limit_frame_size,
    max_frame_bytes,
    merge_top,
)
from transfer.messages import TransferReadyMsg, TransferRequestMsg, encode_msg

pytestmark = pytest.mark.timeout(60)

SECRET = new_secret()
MIB = 1 << 20


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _pull(ctx: zmq.Context[zmq.Socket[bytes]], limit: int | None) -> tuple[zmq.Socket[bytes], str]:
    sock = ctx.socket(zmq.PULL)
    if limit is not None:
        limit_frame_size(sock, limit)
    return sock, f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"


def _reader(sock: zmq.Socket[bytes], addr: str, budget: ReadBudget) -> SealedReader:
    return SealedReader(sock, Opener(SECRET, addr), RejectsByPeer(addr), budget)


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _read_until(reader: SealedReader, n: int, timeout_s: float) -> list[bytes]:
    got: list[bytes] = []
    end = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < end:
        got += [r.payload for r in reader.read()]
        time.sleep(0.005)
    return got


def test_a_frame_over_the_limit_is_dropped_before_it_is_allocated(ctx) -> None:  # noqa: ANN001
    limited, addr = _pull(ctx, limit=64 * 1024)
    reader = _reader(limited, addr, ReadBudget())
    before = _rss_bytes()
    run_stranger([{"push": addr, "frames": [], "zeros": [256 * MIB]}])
    time.sleep(0.5)
    assert reader.read() == [] and reader._opener.drops.total == 0  # nothing reached it
    assert _rss_bytes() - before < 32 * MIB, "the oversized frame was allocated"
    # the socket goes on: the stranger's connection was dropped, a member's works
    push = ctx.socket(zmq.PUSH)
    push.connect(addr)
    sealer = Sealer(SECRET, addr)
    push.send(sealer.seal(b"after"))
    assert _read_until(reader, 1, 10) == [b"after"]
    # The control: without the limit the same frame is taken in whole.
    open_sock, open_addr = _pull(ctx, limit=None)
    run_stranger([{"push": open_addr, "frames": [], "zeros": [16 * MIB]}])
    assert len(open_sock.recv()) == 16 * MIB


def _read_all(reader: SealedReader, num_frames: int) -> tuple[list[int], list[bytes]]:
    """Read until ``num_frames`` frames were taken: the frames each read took, the payloads."""
    sizes: list[int] = []
    payloads: list[bytes] = []
    end = time.monotonic() + 10
    while sum(sizes) < num_frames and time.monotonic() < end:
        before = reader.num_rejected + len(payloads)
        payloads += [r.payload for r in reader.read()]
        if n := reader.num_rejected + len(payloads) - before:
            sizes.append(n)
        time.sleep(0.02)  # more frames come in meanwhile
    return sizes, payloads


def test_a_read_takes_at_most_its_budget_and_counts_refusals_by_sender(ctx) -> None:  # noqa: ANN001
    sock, addr = _pull(ctx, limit=MIB)
    reader = _reader(sock, addr, ReadBudget(max_frames=10, max_bytes=MIB))
    push = ctx.socket(zmq.PUSH)
    push.connect(addr)
    sealer = Sealer(SECRET, addr)
    for i in range(25):
        push.send(b"junk %d" % i)
        if i % 5 == 0:
            push.send(sealer.seal(b"ok %d" % i))
    push.send_multipart([b"two", b"parts"])  # not one frame: refused too
    time.sleep(0.3)  # all queued (mostly): an unbounded read would take them in one go
    sizes, payloads = _read_all(reader, 31)  # 25 junk + 5 sealed + 1 two-part message
    assert sum(sizes) == 31 and max(sizes) <= 10 and len(sizes) >= 4, sizes
    assert payloads == [b"ok %d" % i for i in range(0, 25, 5)]
    assert reader.num_bad_parts == 1 and reader._opener.drops.total == 25
    assert reader._rejects.top() == {"127.0.0.1": 26}

    # the byte budget: frames of 300 bytes, 1,000 bytes a read -> 4 frames (it passes 1,000)
    by_bytes = SealedReader(sock, Opener(SECRET, addr), RejectsByPeer(addr), ReadBudget(100, 1000))
    for _ in range(8):
        push.send(bytes(300))
    time.sleep(0.3)
    sizes, _ = _read_all(by_bytes, 8)
    assert sum(sizes) == 8 and max(sizes) <= 4 and len(sizes) >= 2, sizes


def test_refusals_by_peer_stay_bounded_and_keep_the_heaviest() -> None:
    rejects = RejectsByPeer("test", max_peers=4)
    for _ in range(50):
        rejects.add("10.0.0.1")
    for i in range(1000):  # many addresses, a few frames each
        rejects.add(f"10.1.{i // 250}.{i % 250}")
        assert len(rejects._counts) <= 8
    top = rejects.top()
    assert len(top) == 4 and next(iter(top.items())) == ("10.0.0.1", 50)
    assert merge_top({"a": 3, "b": 1}, {"b": 5, "c": 1}, max_peers=2) == {"b": 6, "a": 3}


@pytest.mark.parametrize("max_model_len", [2, 8192, 131072])
def test_the_limit_holds_the_largest_legitimate_messages(max_model_len: int) -> None:
    limit = max_frame_bytes(max_model_len)
    ids = [2**32 - 1] * max_model_len  # the longest msgpack ids
    # the sampling parameters the server takes with its default limits, at their largest
    sampling = SamplingParams(
        max_tokens=MAX_INT32,
        stop=tuple("\U0001f600" * 1024 for _ in range(32)),  # 4 bytes a character
        stop_token_ids=tuple(range(MAX_INT32 - 1023, MAX_INT32 + 1)),
        logit_bias=tuple((MAX_INT32 - 1023 + i, -99.5) for i in range(1024)),
        seed=MAX_SEED,
    )
    prefill = PrefillReqMsg(
        request_id="r" * 64,
        prompt_ids=ids,
        sampling=sampling,
        namespace="n" * 64,
        decode_node="decode-123",
        decode_addr="tcp://255.255.255.255:65535",
        decode_transfer_addr="tcp://255.255.255.255:65535",
    )
    event = CacheEventMsg(node_id="prefill-1", seq=2**62, kind="inserted", namespace="n" * 64,
                          tokens=ids)  # fmt: skip
    request = TransferRequestMsg(transfer_id="r" * 64, num_tokens=max_model_len,
                                 group_prefix="kvx/" + "x" * 190, backend="gloo", num_layers=128,
                                 elems_per_token=2**20, dtype="bf16", token_ids=ids)  # fmt: skip
    ready = TransferReadyMsg(transfer_id="r" * 64, slots=ids, num_cached_tokens=0)
    sealer = Sealer(SECRET, "tcp://255.255.255.255:65535")
    frames = [
        sealer.seal(msgspec.msgpack.encode(prefill)),
        sealer.seal(msgspec.msgpack.encode(event)),
        sealer.seal(encode_msg(request)),
        sealer.seal(encode_msg(ready)),
    ]
    assert max(len(f) for f in frames) <= limit, ([len(f) for f in frames], limit)
    assert limit < 2 * MIB + 5 * max_model_len  # and not much more


def test_the_control_plane_reads_a_bounded_batch_per_call(ctx) -> None:  # noqa: ANN001
    from transfer.control import CONTROL_BUDGET, ControlPlane

    plane = ControlPlane(SECRET)
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(plane.endpoint)
        num_frames = 3 * CONTROL_BUDGET.max_frames
        for i in range(num_frames):
            dealer.send(b"junk %d" % i)
        time.sleep(0.3)  # all queued (mostly): an unbounded read would take them in one go
        counts: list[int] = []
        end = time.monotonic() + 10
        while sum(counts) < num_frames and time.monotonic() < end:
            before = plane.num_rejected
            assert plane.recv_all() == []
            if n := plane.num_rejected - before:
                counts.append(n)
            time.sleep(0.02)
        assert sum(counts) == num_frames and max(counts) <= CONTROL_BUDGET.max_frames, counts
        assert len(counts) >= 3, counts
    finally:
        plane.close()


def test_a_members_frames_from_before_the_epoch_are_dropped_but_not_counted_as_rejected(
    ctx,  # noqa: ANN001
) -> None:
    """A node's heartbeats queued while the server was not bound (sealed before its reader's
    epoch) are authentic: dropped, counted apart, and their sender is not among the rejected
    ones (the cluster's own nodes showed up there at every start); a stranger's junk is."""
    sock, addr = _pull(ctx, limit=MIB)
    push = ctx.socket(zmq.PUSH)
    push.connect(addr)
    queued = Sealer(SECRET, addr, clock=lambda: time.time() - 30.0)  # before the epoch
    for i in range(5):
        push.send(queued.seal(b"old %d" % i))
    push.send(b"junk")
    push.send(Sealer(SECRET, addr).seal(b"new"))
    reader = SealedReader(
        sock, Opener(SECRET, addr, max_age_s=60.0, clock=time.time), RejectsByPeer(addr),
        ReadBudget(),
    )  # fmt: skip
    assert _read_until(reader, 1, 10) == [b"new"]
    assert reader.num_before_epoch == 5
    assert reader.num_rejected == 1 and reader._rejects.top() == {"127.0.0.1": 1}
