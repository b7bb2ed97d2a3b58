"""A process without the cluster secret against the transfer plane: a decode node's control
port (forged requests that would make it dial anywhere) and a pair group's TCPStore."""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Iterator

import pytest
import torch
import zmq

from tests.security.helpers import capture, random_frames, run_stranger, unsigned
from tests.transfer.helpers import TrackingOwner, assert_moved, buffers, make_pool, run_until
from transfer import KVPoll, TransferAgent, TransferConfig
from transfer.auth import Sealer, new_secret, reply_audience
from transfer.backend import PairError
from transfer.group import TorchPairGroup, host_store
from transfer.messages import TransferRequestMsg

pytestmark = pytest.mark.timeout(90)

CFG = TransferConfig(
    backend="gloo", handshake_timeout_s=20.0, timeout_s=20.0, connect_timeout_s=20.0
)


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """Some host:port a forged request names: it must never be dialled."""
    srv = socket.create_server(("127.0.0.1", 0))
    yield srv
    srv.close()


def _was_dialled(srv: socket.socket, wait_s: float) -> bool:
    return bool(select.select([srv], [], [], wait_s)[0])


def _request_to(srv: socket.socket, layout_of: TransferAgent) -> TransferRequestMsg:
    lo = layout_of.layout
    port = srv.getsockname()[1]
    return TransferRequestMsg(
        transfer_id="evil",
        num_tokens=2,
        store_host="127.0.0.1",
        store_port=port,
        group_prefix="kvx/evil/0",
        backend="gloo",
        num_layers=lo.num_layers,
        elems_per_token=lo.elems_per_token,
        dtype=lo.dtype_name,
    )


def test_forged_transfer_requests_reach_no_handler_and_dial_nothing(
    listener: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dst = make_pool(seed=1), make_pool(seed=None)
    owner = TrackingOwner()
    captured = capture(monkeypatch)
    s = TransferAgent(CFG, buffers(src), src.num_layers)
    r = TransferAgent(CFG, buffers(dst), dst.num_layers, owner)
    try:
        snd = s.sender("t", r.endpoint, 4)  # in flight: reserved, data not sent yet
        rcv = r.receiver("t")
        assert run_until(lambda: rcv.poll() == KVPoll.WAITING, [s, r], 20)
        forged = _request_to(listener, r)
        to_r = random_frames(3, seed=7) + [
            unsigned(forged),
            captured.first(r.endpoint),  # the real request, replayed
            captured.first(reply_audience(r.endpoint)),  # r's own reply, sent back to it
        ]
        run_stranger([
            {"dealer": r.endpoint, "frames": to_r},
            {"dealer": s.endpoint, "frames": random_frames(2, seed=8)},
        ])  # fmt: skip
        assert run_until(lambda: r.num_rejected_msgs == len(to_r), [s, r], 10)
        assert run_until(lambda: s.num_rejected_msgs == 2, [s, r], 10)
        assert not _was_dialled(listener, 1.0)
        assert r.num_dropped_msgs == 0 and set(owner.reserved) == {"t"}  # no other reservation
        assert r._ctrl._opener.drops.num_replayed == 1

        snd.send([9, 3, 40, 41])
        assert run_until(lambda: snd.poll().is_final and rcv.poll().is_final, [s, r], 20)
        assert (snd.poll(), rcv.poll()) == (KVPoll.SUCCESS, KVPoll.SUCCESS), snd.failure
        assert_moved(src, [9, 3, 40, 41], dst, rcv.slots)

        # The same request sealed with the secret is obeyed: the refusal above was the seal's.
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(r.endpoint)
        dealer.send(Sealer(CFG.secret, r.endpoint).seal(unsigned_bytes(forged)))
        assert run_until(lambda: _was_dialled(listener, 0.01), [r], 10)
        dealer.close()
    finally:
        s.close()
        r.close()


def unsigned_bytes(msg: TransferRequestMsg) -> bytes:
    return bytes.fromhex(unsigned(msg))


def _listening_hosts(port: int) -> set[str]:
    """Local addresses of the LISTEN sockets on ``port`` (from /proc, no traffic)."""
    hosts = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if state == "0A" and int(p, 16) == port:
            hosts.add(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    return hosts


def _pair(prefix: str, rank: int, port: int, secret: bytes, store=None) -> TorchPairGroup:  # noqa: ANN001
    return TorchPairGroup(
        "gloo", store_host="127.0.0.1", store_port=port, prefix=prefix, rank=rank,
        timeout_s=20.0, device=torch.device("cpu"), secret=secret, store=store,
    )  # fmt: skip


def test_a_stranger_in_a_pair_store_cannot_join_and_breaks_only_that_pair() -> None:
    secret = new_secret()
    store = host_store("127.0.0.1", 20.0)
    assert _listening_hosts(store.port) == {"127.0.0.1"}  # not every interface

    # A stranger poses as rank 1 of "kvx/p/0": rank 0 refuses it at once, no group is built.
    junk = {"kvx/p/0/auth/nonce1": "11" * 16, "kvx/p/0/auth/proof1": "22" * 32}
    run_stranger([{"store": ["127.0.0.1", store.port], "set": junk}])
    with pytest.raises(PairError, match="rank 1 failed the proof of the cluster secret"):
        _pair("kvx/p/0", 0, store.port, secret, store)

    # Another secret (a stranger that found a live pair's prefix) is refused by both ends.
    errors: list[str] = []

    def rank1(prefix: str, key: bytes, out: list[TorchPairGroup]) -> None:
        try:
            out.append(_pair(prefix, 1, store.port, key))
        except PairError as e:
            errors.append(str(e))

    t = threading.Thread(target=rank1, args=("kvx/p/1", new_secret(), []))
    t.start()
    with pytest.raises(PairError, match="rank 1 failed the proof"):
        _pair("kvx/p/1", 0, store.port, secret, store)
    t.join(30)
    assert len(errors) == 1 and "rank 0 failed the proof" in errors[0]

    # The store still serves the cluster's own pairs.
    out: list[TorchPairGroup] = []
    t = threading.Thread(target=rank1, args=("kvx/p/2", secret, out))
    t.start()
    g0 = _pair("kvx/p/2", 0, store.port, secret, store)
    t.join(30)
    x, y = torch.arange(6.0), torch.zeros(6)
    recv = out[0].irecv(y)
    g0.isend(x).wait(10)
    recv.wait(10)
    assert torch.equal(x, y)
    g0.close()
    out[0].close()
