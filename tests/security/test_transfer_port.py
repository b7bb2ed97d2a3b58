"""A process without the cluster secret against the transfer plane: a node's control port
(forged and replayed requests, replies and rendezvous keys), the rendezvous of pair groups
(no store listens anywhere: nothing to list, read or write), and a reply meant for another
DEALER."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from typing import NamedTuple

import pytest
import torch.distributed as dist

from pd.core.kv_pool import KVPool
from tests.security.helpers import (
    capture,
    listening_ports,
    random_frames,
    run_stranger,
    unsigned,
)
from tests.transfer.helpers import TrackingOwner, assert_moved, buffers, make_pool, run_until
from transfer.agent import TransferAgent
from transfer.auth import HEADER_BYTES, TAG_BYTES, Sealer, new_secret, reply_audience
from transfer.control import ControlPlane
from transfer.messages import (
    ControlMsg,
    NoRoomMsg,
    PairKeyMsg,
    TransferRequestMsg,
    decode_msg,
    encode_msg,
)
from transfer.state import KVPoll, TransferConfig

pytestmark = pytest.mark.timeout(90)

CFG = TransferConfig(
    backend="gloo", handshake_timeout_s=20.0, timeout_s=20.0, connect_timeout_s=20.0
)


class Pair(NamedTuple):
    s: TransferAgent
    r: TransferAgent
    owner: TrackingOwner
    src: KVPool
    dst: KVPool


@pytest.fixture
def pair() -> Iterator[Pair]:
    src, dst = make_pool(seed=1), make_pool(seed=None)
    owner = TrackingOwner()
    s = TransferAgent(CFG, buffers(src), src.num_layers)
    r = TransferAgent(CFG, buffers(dst), dst.num_layers, owner)
    try:
        yield Pair(s, r, owner, src, dst)
    finally:
        s.close()
        r.close()


def _move(p: Pair, tid: str, slots: list[int]) -> None:
    """One transfer from ``p.s`` to ``p.r``, to success, its KV checked."""
    snd, rcv = p.s.sender(tid, p.r.endpoint, len(slots)), p.r.receiver(tid)
    snd.send(slots)
    assert run_until(lambda: snd.poll().is_final and rcv.poll().is_final, [p.s, p.r], 30)
    assert (snd.poll(), rcv.poll()) == (KVPoll.SUCCESS, KVPoll.SUCCESS), snd.failure
    assert_moved(p.src, slots, p.dst, rcv.slots)


def _evil_request(layout_of: TransferAgent) -> TransferRequestMsg:
    lo = layout_of.layout
    return TransferRequestMsg(
        transfer_id="evil",
        num_tokens=2,
        group_prefix="kvx/evil/0",
        backend="gloo",
        num_layers=lo.num_layers,
        elems_per_token=lo.elems_per_token,
        dtype=lo.dtype_name,
    )


def _message(frame: bytes) -> ControlMsg:
    return decode_msg(frame[HEADER_BYTES:-TAG_BYTES])


def _sealed_for(frames: dict[str, list[bytes]], audience: str, kind: type) -> list[bytes]:
    """Frames sealed for ``audience`` that hold a ``kind`` message (a sniffer's pick)."""
    return [f for f in frames.get(audience, []) if isinstance(_message(f), kind)]


def test_forged_and_replayed_control_frames_reach_no_handler(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    s, r, owner = pair.s, pair.r, pair.owner
    captured = capture(monkeypatch)
    snd, rcv = s.sender("t", r.endpoint, 4), r.receiver("t")
    # in flight: slots reserved, the pair group built, the data not sent yet
    assert run_until(lambda: rcv.poll() == KVPoll.WAITING and s.num_pairs == 1, [s, r], 20)
    assert run_until(lambda: s.num_rendezvous == r.num_rendezvous == 0, [s, r], 20)
    requests = _sealed_for(captured.frames, r.endpoint, TransferRequestMsg)
    keys = _sealed_for(captured.frames, r.endpoint, PairKeyMsg)
    assert requests and keys
    group = _message(requests[0]).group_prefix  # type: ignore[union-attr]
    # what a sniffer saw is enough to name the pair, not to write into its rendezvous
    forged_key = PairKeyMsg(group_prefix=group, key=_message(keys[0]).key, value=b"127.0.0.1:9")  # type: ignore[union-attr]
    to_r = random_frames(3, seed=7) + [
        unsigned(_evil_request(r)),  # would reserve slots and start a rendezvous
        unsigned(forged_key),
        *(f.hex() for f in requests + keys),  # the sender's request and keys, replayed
        captured.first_reply(r.endpoint),  # r's own reply, sent back to it
    ]
    to_s = random_frames(2, seed=8) + [captured.first_reply(r.endpoint)]  # not for a ROUTER
    results = run_stranger([
        {"dealer": r.endpoint, "frames": to_r, "listen_s": 1.0},
        {"dealer": s.endpoint, "frames": to_s, "listen_s": 0.2},
    ])  # fmt: skip
    assert [res["num_received"] for res in results] == [0, 0]  # nothing answers a stranger
    assert run_until(lambda: r.num_rejected_msgs == len(to_r), [s, r], 10)
    assert run_until(lambda: s.num_rejected_msgs == len(to_s), [s, r], 10)
    assert r._ctrl._opener.drops.num_replayed == len(requests) + len(keys)
    assert r.num_dropped_msgs == 0 and set(owner.reserved) == {"t"}  # no other reservation
    assert r.num_rendezvous == 0 and r.num_pairs == 1  # none started for the stranger
    assert r.rejects.top() == {"127.0.0.1": len(to_r)}

    snd.send([9, 3, 40, 41])
    assert run_until(lambda: snd.poll().is_final and rcv.poll().is_final, [s, r], 20)
    assert (snd.poll(), rcv.poll()) == (KVPoll.SUCCESS, KVPoll.SUCCESS), snd.failure
    assert_moved(pair.src, [9, 3, 40, 41], pair.dst, rcv.slots)

    # The same request sealed with the secret is obeyed: the refusal above was the seal's.
    ctrl = ControlPlane(CFG.secret)
    try:
        ctrl.send(r.endpoint, _evil_request(r))
        assert run_until(lambda: "evil" in owner.reserved, [r], 10)
    finally:
        ctrl.close()


@pytest.mark.slow
def test_no_store_listens_and_a_stranger_cannot_list_read_or_write_a_rendezvous_entry(
    pair: Pair,
) -> None:
    _move(pair, "a", [1, 2, 3])  # a pair group built: its rendezvous is over
    ports = listening_ports()  # every port this process (both agents) listens on
    endpoints = {pair.s.endpoint, pair.r.endpoint}
    assert {f"tcp://127.0.0.1:{p}" for p in ports} >= endpoints
    # The probe works: a real TCPStore, as pair groups used to rendezvous over, is listed,
    # read and written by anyone who reaches it.
    control = dist.TCPStore(
        "127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False
    )
    control.set("kvx/p/0/0/0", b"rank 0's address")
    (result,) = run_stranger([
        {"probe_stores": [["127.0.0.1", p] for p in [*ports, control.port]], "timeout_s": 3.0}
    ])  # fmt: skip
    by_port = {probe["port"]: probe for probe in result["probes"]}
    assert by_port[control.port]["answered"] and "kvx/p/0/0/0" in by_port[control.port]["keys"]
    answered = [p for p in ports if by_port[p]["answered"]]
    assert answered == [], [by_port[p] for p in answered]
    _move(pair, "b", [6, 7, 8])  # the probes (into gloo's and zmq's ports) broke nothing


def test_a_reply_is_accepted_only_by_the_dealer_it_was_sealed_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    secret = new_secret()
    captured = capture(monkeypatch)
    d, p1, p2 = ControlPlane(secret), ControlPlane(secret), ControlPlane(secret)
    try:
        for i, p in enumerate((p1, p2)):
            p.send(d.endpoint, NoRoomMsg(transfer_id=f"from-p{i + 1}"))
        got: dict[str, bytes] = {}
        for _ in range(5000):  # up to ~10 s
            for inc in d.recv_all():
                assert inc.identity is not None
                got[inc.msg.transfer_id] = inc.identity  # type: ignore[union-attr]
            if len(got) == 2:
                break
            time.sleep(0.002)
        id1, id2 = got["from-p1"], got["from-p2"]
        d.reply(id1, NoRoomMsg(transfer_id="for-p1"))
        (frame,) = captured.frames[reply_audience(d.endpoint, id1)]
        # The reply for p1's dealer, delivered to p2's: p2 refuses it (it is not its audience).
        d._router.send_multipart([id2, frame])
        d.reply(id2, NoRoomMsg(transfer_id="for-p2"))
        seen: dict[str, list[str]] = {"p1": [], "p2": []}
        for _ in range(5000):  # up to ~10 s
            for name, p in (("p1", p1), ("p2", p2)):
                seen[name] += [inc.msg.transfer_id for inc in p.recv_all()]  # type: ignore[union-attr]
            if seen["p1"] and seen["p2"]:
                break
            time.sleep(0.002)
        assert seen == {"p1": ["for-p1"], "p2": ["for-p2"]}
        assert (p1.num_rejected, p2.num_rejected) == (0, 1)
        # A peer whose clock lags by 5 s: its reply is still taken (a dealer needs no epoch:
        # nothing sealed before it was made can name its fresh routing id).
        lagging = Sealer(secret, reply_audience(d.endpoint, id1), clock=lambda: time.time() - 5)
        d._router.send_multipart([id1, lagging.seal(encode_msg(NoRoomMsg(transfer_id="late")))])
        for _ in range(5000):  # up to ~10 s
            if late := [inc.msg.transfer_id for inc in p1.recv_all()]:  # type: ignore[union-attr]
                break
            time.sleep(0.002)
        assert late == ["late"] and p1.num_rejected == 0
    finally:
        for p in (d, p1, p2):
            p.close()
