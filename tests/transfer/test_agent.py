"""Sender/receiver state machines in one process: fake data path (and gloo once), real zmq."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
import zmq

from pd.core.kv_pool import KVPool
from pd.executor import cpu_attention
from tests.transfer.helpers import (
    HEAD_DIM,
    NUM_HEADS,
    NUM_LAYERS,
    NUM_SLOTS,
    TrackingOwner,
    assert_moved,
    assert_untouched,
    buffers,
    make_pool,
    run_until,
)
from transfer.agent import TransferAgent
from transfer.auth import Sealer
from transfer.messages import TransferDoneMsg, TransferStartMsg, encode_msg
from transfer.state import KVPoll, TransferConfig

pytestmark = pytest.mark.timeout(30)

FAST = dict(handshake_timeout_s=2.0, timeout_s=2.0, connect_timeout_s=5.0, retry_interval_s=0.01)


def _make_pair(
    backend: str = "fake", **overrides: float
) -> tuple[TransferAgent, TransferAgent, TrackingOwner]:
    cfg = TransferConfig(backend=backend, **{**FAST, **overrides})
    src, dst = make_pool(seed=1), make_pool(seed=None)
    owner = TrackingOwner()
    sender = TransferAgent(cfg, buffers(src), src.num_layers)
    receiver = TransferAgent(cfg, buffers(dst), dst.num_layers, owner)
    sender.pool, receiver.pool = src, dst  # type: ignore[attr-defined]
    return sender, receiver, owner


@pytest.fixture
def pair() -> Iterator[tuple[TransferAgent, TransferAgent, TrackingOwner]]:
    s, r, owner = _make_pair()
    yield s, r, owner
    s.close()
    r.close()


def _both_final(*handles: object) -> bool:
    return all(h.poll().is_final for h in handles)  # type: ignore[attr-defined]


@pytest.mark.parametrize("backend", ["fake", "gloo"])
def test_concurrent_transfers_move_scattered_slots_bit_exact(backend: str) -> None:
    s, r, owner = _make_pair(backend)
    try:
        src_slots = {"a": [5, 17, 3, 40, 41, 9], "b": [63, 0, 22], "c": [30, 2, 11, 50, 7]}
        senders = {t: s.sender(t, r.endpoint, len(sl)) for t, sl in src_slots.items()}
        receivers = {t: r.receiver(t) for t in src_slots}
        for t, sl in src_slots.items():
            senders[t].send(sl)
        assert run_until(lambda: _both_final(*senders.values(), *receivers.values()), [s, r], 15)
        written: list[int] = []
        for t, sl in src_slots.items():
            assert senders[t].poll() == KVPoll.SUCCESS, senders[t].failure
            assert receivers[t].poll() == KVPoll.SUCCESS, receivers[t].failure
            assert_moved(s.pool, sl, r.pool, receivers[t].slots)  # type: ignore[attr-defined]
            written += receivers[t].slots
        assert len(set(written)) == len(written) == 14
        assert_untouched(r.pool, written)  # type: ignore[attr-defined]
        assert owner.released == []
        owner.check()
    finally:
        s.close()
        r.close()


def test_receiver_prefix_hit_moves_only_the_tail(pair) -> None:
    s, r, owner = pair
    owner.cached[(1, 2, 3, 4)] = 4
    snd = s.sender("t", r.endpoint, 6, token_ids=[1, 2, 3, 4, 5, 6])
    snd.send([10, 11, 12, 13, 14, 15])
    rcv = r.receiver("t")
    assert run_until(lambda: _both_final(snd, rcv), [s, r], 10)
    assert (snd.poll(), rcv.poll()) == (KVPoll.SUCCESS, KVPoll.SUCCESS)
    assert snd.num_cached_tokens == rcv.num_cached_tokens == 4
    assert len(rcv.slots) == 2
    assert_moved(s.pool, [14, 15], r.pool, rcv.slots)
    assert_untouched(r.pool, rcv.slots)


def test_layers_move_as_they_become_ready(pair) -> None:
    s, r, _ = pair
    snd = s.sender("t", r.endpoint, 4)
    rcv = r.receiver("t")
    snd.send([1, 2, 3, 4], num_ready_layers=0)
    assert run_until(lambda: rcv.poll() == KVPoll.TRANSFERRING, [s, r], 5)
    for layer in range(1, s.layout.num_layers + 1):
        run_until(lambda: False, [s, r], 0.05)
        assert rcv.poll() == KVPoll.TRANSFERRING, f"finished with only {layer - 1} layers"
        snd.set_ready_layers(layer)
    assert run_until(lambda: _both_final(snd, rcv), [s, r], 5)
    assert rcv.poll() == KVPoll.SUCCESS
    assert_moved(s.pool, [1, 2, 3, 4], r.pool, rcv.slots)


def test_no_room_is_retried_until_slots_free(pair) -> None:
    s, r, owner = pair
    first = s.sender("big", r.endpoint, 60)
    first.send(list(range(60)))
    assert run_until(lambda: first.poll().is_final, [s, r], 10)
    second = s.sender("late", r.endpoint, 10)
    second.send(list(range(10, 20)))
    run_until(lambda: False, [s, r], 0.2)
    assert second.poll() == KVPoll.BOOTSTRAPPING  # asked again and again, no room yet
    owner.alloc.free(owner.take("big"))  # the decode node finishes the first request
    assert run_until(lambda: second.poll().is_final, [s, r], 5)
    assert second.poll() == KVPoll.SUCCESS, second.failure
    assert_moved(s.pool, range(10, 20), r.pool, r.receiver("late").slots)


def test_no_room_until_handshake_timeout_fails_cleanly(pair) -> None:
    s, r, owner = pair
    t0 = time.monotonic()
    snd = s.sender("huge", r.endpoint, 65)  # more than the whole pool
    snd.send(list(range(64)) + [0])
    assert run_until(lambda: snd.poll().is_final, [s, r], 10)
    assert snd.poll() == KVPoll.FAILED and "no room" in (snd.failure or "")
    assert 2.0 <= time.monotonic() - t0 < 4
    assert owner.alloc.num_free_slots == 64
    owner.check()


def test_sender_abort_while_waiting_frees_receiver_slots(pair) -> None:
    s, r, owner = pair
    snd = s.sender("t", r.endpoint, 8)
    rcv = r.receiver("t")
    assert run_until(lambda: rcv.poll() == KVPoll.WAITING, [s, r], 5)
    assert owner.alloc.num_free_slots == 56
    snd.abort()
    assert run_until(lambda: rcv.poll() == KVPoll.FAILED, [s, r], 5)
    assert owner.released == ["t"] and owner.alloc.num_free_slots == 64
    assert "aborted by sender" in (rcv.failure or "")


def test_receiver_abort_mid_transfer_releases_after_data_stops(pair) -> None:
    s, r, owner = pair
    snd = s.sender("t", r.endpoint, 8)
    rcv = r.receiver("t")
    snd.send(list(range(8)), num_ready_layers=1)
    assert run_until(lambda: rcv.poll() == KVPoll.TRANSFERRING, [s, r], 5)
    rcv.abort("client went away")
    assert rcv.poll() == KVPoll.FAILED
    assert run_until(lambda: snd.poll() == KVPoll.FAILED and owner.released == ["t"], [s, r], 5)
    assert "client went away" in (snd.failure or "")
    assert owner.alloc.num_free_slots == 64
    owner.check()
    # The pair stayed in step (the rest of the stream was drained): the next one works.
    nxt = s.sender("u", r.endpoint, 3)
    nxt.send([7, 8, 9])
    assert run_until(lambda: nxt.poll().is_final, [s, r], 5)
    assert nxt.poll() == KVPoll.SUCCESS, nxt.failure
    assert_moved(s.pool, [7, 8, 9], r.pool, r.receiver("u").slots)


def test_sender_that_never_sends_times_out_and_receiver_frees(pair) -> None:
    s, r, owner = pair
    snd = s.sender("t", r.endpoint, 5)
    rcv = r.receiver("t")
    t0 = time.monotonic()
    assert run_until(lambda: _both_final(snd, rcv), [s, r], 10)
    assert 2.0 <= time.monotonic() - t0 < 4
    assert (snd.poll(), rcv.poll()) == (KVPoll.FAILED, KVPoll.FAILED)
    assert owner.released == ["t"] and owner.alloc.num_free_slots == 64


def test_stalled_data_breaks_the_pair_and_the_next_transfer_rebuilds_it(pair) -> None:
    s, r, owner = pair
    snd = s.sender("stall", r.endpoint, 4)
    snd.send([1, 2, 3, 4], num_ready_layers=0)  # the forward pass never finishes layer 0
    rcv = r.receiver("stall")
    assert run_until(lambda: _both_final(snd, rcv) and owner.released, [s, r], 10)
    assert (snd.poll(), rcv.poll()) == (KVPoll.FAILED, KVPoll.FAILED)
    assert owner.alloc.num_free_slots == 64
    assert run_until(lambda: s.num_pairs == r.num_pairs == 0, [s, r], 5)
    nxt = s.sender("next", r.endpoint, 2)
    nxt.send([5, 6])
    assert run_until(lambda: nxt.poll().is_final, [s, r], 10)
    assert nxt.poll() == KVPoll.SUCCESS, nxt.failure


def test_layout_mismatch_is_refused() -> None:
    cfg = TransferConfig(backend="fake", **FAST)
    src, dst = make_pool(seed=1), make_pool(seed=None)
    s = TransferAgent(cfg, buffers(src), src.num_layers)
    r = TransferAgent(cfg, buffers(dst)[:4], 2, TrackingOwner())  # 2 layers, not 3
    try:
        snd = s.sender("t", r.endpoint, 2)
        assert run_until(lambda: snd.poll().is_final, [s, r], 5)
        assert snd.poll() == KVPoll.FAILED and "layout" in (snd.failure or "")
    finally:
        s.close()
        r.close()


def _int8_pool(seed: int | None) -> KVPool:
    """``make_pool``'s shape as int8 rows (codes and each row's 4 scale bytes: --kv-cache-dtype
    int8), random bytes or the -7 sentinel."""
    pool = KVPool(NUM_LAYERS, NUM_SLOTS, NUM_HEADS, HEAD_DIM, quantize=cpu_attention.quantize)
    gen = torch.Generator().manual_seed(seed or 0)
    for t in pool.k + pool.v:
        t.copy_(torch.randint(-128, 128, t.shape, generator=gen) if seed is not None else -7)
    return pool


@pytest.mark.parametrize("backend", ["fake", "gloo"])
def test_int8_kv_moves_bit_exact_and_a_pool_of_another_dtype_refuses_it(backend: str) -> None:
    cfg = TransferConfig(backend=backend, **FAST)
    src, dst, fp32 = _int8_pool(1), _int8_pool(None), make_pool(seed=None)
    s = TransferAgent(cfg, buffers(src), src.num_layers)
    r = TransferAgent(cfg, buffers(dst), dst.num_layers, TrackingOwner())
    other = TransferAgent(cfg, buffers(fp32), fp32.num_layers, TrackingOwner())
    try:
        snd, rcv = s.sender("t", r.endpoint, 3), r.receiver("t")
        snd.send([9, 2, 40])
        assert run_until(lambda: _both_final(snd, rcv), [s, r], 15)
        assert snd.poll() == KVPoll.SUCCESS, snd.failure
        assert_moved(src, [9, 2, 40], dst, rcv.slots)
        assert_untouched(dst, rcv.slots)
        refused = s.sender("u", other.endpoint, 2)
        assert run_until(lambda: refused.poll().is_final, [s, other], 10)
        assert refused.poll() == KVPoll.FAILED
        assert "'int8') != receiver's" in (refused.failure or "")
        assert "'float32')" in (refused.failure or "")
    finally:
        for agent in (s, r, other):
            agent.close()


def test_unreachable_receiver_fails_within_handshake_timeout() -> None:
    cfg = TransferConfig(backend="fake", **{**FAST, "handshake_timeout_s": 0.5})
    src = make_pool(seed=1)
    s = TransferAgent(cfg, buffers(src), src.num_layers)
    try:
        snd = s.sender("t", "tcp://127.0.0.1:9", 2)  # nobody listens there
        assert run_until(lambda: snd.poll().is_final, [s], 3)
        assert snd.poll() == KVPoll.FAILED and "no answer" in (snd.failure or "")
    finally:
        s.close()


def test_malformed_control_messages_are_dropped_and_the_loop_goes_on(pair) -> None:
    s, r, owner = pair
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(r.endpoint)
    sealer = Sealer(r.cfg.secret, r.endpoint)  # authentic frames, malformed messages
    try:
        sock.send(sealer.seal(b"\xc1 not msgpack"))
        sock.send(sealer.seal(encode_msg(TransferDoneMsg(transfer_id="x"))[:-1]))  # truncated
        sock.send(sealer.seal(b"\x82\xa4type\xa8no_room!\xa3xid\x01"))  # unknown tag
        sock.send_multipart([b"a", b"b"])  # wrong frame count: not even a frame, refused
        ghost = TransferStartMsg(transfer_id="ghost", seq=0, group_prefix="no/such/group")
        sock.send(sealer.seal(encode_msg(ghost)))
        assert run_until(lambda: r.num_dropped_msgs >= 3 and r.num_rejected_msgs, [r], 5)
        snd = s.sender("t", r.endpoint, 3)
        snd.send([4, 5, 6])
        assert run_until(lambda: snd.poll().is_final, [s, r], 5)
        assert snd.poll() == KVPoll.SUCCESS, snd.failure
        assert (r.num_dropped_msgs, r.num_rejected_msgs) == (3, 1)
    finally:
        sock.close()


def test_layout_gather_scatter_round_trip() -> None:
    from transfer.datapath import KVLayout

    src, dst = make_pool(seed=3), make_pool(seed=None)
    a, b = KVLayout(buffers(src), 3), KVLayout(buffers(dst), 3)
    assert a.elems_per_token == 2 * 2 * 4 and a.num_bytes_per_token == 3 * 16 * 4
    s_idx, d_idx = torch.tensor([9, 1, 33]), torch.tensor([0, 63, 5])
    flat = torch.empty(3 * a.elems_per_token)
    for layer in range(3):
        a.gather(layer, s_idx, flat)
        # layer buffer = K rows of the slots, then V rows
        assert torch.equal(flat[:24].view(3, 2, 4), src.k[layer][s_idx])
        b.scatter(layer, d_idx, flat)
    assert_moved(src, [9, 1, 33], dst, [0, 63, 5])
    assert_untouched(dst, [0, 63, 5])


def test_config_and_layout_validate() -> None:
    with pytest.raises(ValueError, match="backend"):
        TransferConfig(backend="rdma")
    with pytest.raises(ValueError, match="timeout_s"):
        TransferConfig(timeout_s=0)
    pool = make_pool(seed=1)
    with pytest.raises(ValueError, match="do not split"):
        TransferAgent(TransferConfig(backend="fake"), buffers(pool), 4)
    with pytest.raises(ValueError, match="nccl"):
        TransferAgent(TransferConfig(backend="nccl"), buffers(pool), 3)
