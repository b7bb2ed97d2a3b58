"""Sealed frames: what an ``Opener`` accepts and what it refuses, by reason."""

from __future__ import annotations

import pytest

from transfer.auth import (
    HEADER_BYTES,
    OVERHEAD_BYTES,
    TAG_BYTES,
    Opener,
    Sealer,
    new_secret,
    reply_audience,
)
from transfer.state import TransferConfig

pytestmark = pytest.mark.timeout(10)

SECRET = new_secret()
TO = "tcp://10.0.0.5:5555"


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _drops(opener: Opener) -> tuple[int, int, int, int]:
    d = opener.drops
    assert d.num_before_epoch == 0, d
    return d.num_malformed, d.num_bad_tag, d.num_stale, d.num_replayed


def test_a_sealed_frame_opens_once_and_carries_a_fixed_overhead() -> None:
    sealer, opener = Sealer(SECRET, TO), Opener(SECRET, TO)
    frames = [sealer.seal(b"x" * n) for n in (0, 1, 1000)]
    assert [len(f) for f in frames] == [OVERHEAD_BYTES, OVERHEAD_BYTES + 1, OVERHEAD_BYTES + 1000]
    assert [opener.open(f) for f in frames] == [b"", b"x", b"x" * 1000]
    assert [opener.open(f) for f in frames] == [None, None, None]  # replayed
    assert _drops(opener) == (0, 0, 0, 3) and opener.drops.total == 3


def test_any_altered_byte_and_any_other_key_or_audience_fail_the_tag() -> None:
    frame = Sealer(SECRET, TO).seal(b"hello, node")
    opener = Opener(SECRET, TO)
    for i in range(1, len(frame)):  # byte 0 is the version: a change there is "malformed"
        bad = bytearray(frame)
        bad[i] ^= 0x01
        assert opener.open(bytes(bad)) is None
    assert _drops(opener) == (0, len(frame) - 1, 0, 0)
    assert Opener(new_secret(), TO).open(frame) is None  # another cluster
    assert Opener(SECRET, "tcp://10.0.0.6:5555").open(frame) is None  # another socket
    assert Opener(SECRET, reply_audience(TO, b"\x01" * 16)).open(frame) is None  # the replies
    assert opener.open(frame) == b"hello, node"  # the original is still fresh


def test_a_reply_opens_only_for_the_dealer_it_was_sealed_for() -> None:
    mine, other = b"\xaa" * 16, b"\xbb" * 16
    reply = Sealer(SECRET, reply_audience(TO, mine)).seal(b"ready")
    assert Opener(SECRET, reply_audience(TO, other)).open(reply) is None
    assert Opener(SECRET, reply_audience("tcp://10.0.0.6:5555", mine)).open(reply) is None
    assert Opener(SECRET, reply_audience(TO, mine)).open(reply) == b"ready"


def test_a_restarted_receiver_refuses_what_was_sealed_before_it_started() -> None:
    send_clock, recv_clock = Clock(), Clock()
    sealer = Sealer(SECRET, TO, clock=send_clock)
    first = Opener(SECRET, TO, clock=recv_clock)  # the first lifetime of the socket at TO
    old = [sealer.seal(b"a"), sealer.seal(b"b")]
    assert [first.open(f) for f in old] == [b"a", b"b"]
    send_clock.t += 5.0
    recv_clock.t += 5.0
    # The process restarts at the same address, same secret: an empty memory of streams.
    second = Opener(SECRET, TO, clock=recv_clock, max_clock_skew_s=2.0)
    assert [second.open(f) for f in old] == [None, None]  # replays of the first lifetime
    assert second.drops.num_before_epoch == 2 and second.drops.total == 2
    assert second.open(sealer.seal(b"c")) == b"c"  # the same stream goes on
    # A sender whose clock lags by less than max_clock_skew_s is not refused...
    lagging = Sealer(SECRET, TO, clock=lambda: recv_clock.t - 2.0 + 1.999)
    assert second.open(lagging.seal(b"d")) == b"d"
    # ... one that lags by more is, until its clock passes the epoch.
    behind = Sealer(SECRET, TO, clock=lambda: recv_clock.t - 2.5)
    assert second.open(behind.seal(b"e")) is None
    assert second.drops.num_before_epoch == 3


@pytest.mark.parametrize("frame", [b"", b"\x01", b"\x01" * (OVERHEAD_BYTES - 1), b"\x02" * 64])
def test_short_or_unknown_version_frames_are_malformed(frame: bytes) -> None:
    opener = Opener(SECRET, TO)
    assert opener.open(frame) is None
    assert _drops(opener) == (1, 0, 0, 0)


def test_unsigned_payload_is_refused_whatever_it_holds() -> None:
    opener = Opener(SECRET, TO)
    payload = b"\x01" + bytes(HEADER_BYTES - 1) + b'{"type":"token"}' + bytes(TAG_BYTES)
    assert opener.open(payload) is None
    assert _drops(opener) == (0, 1, 0, 0)


def test_frames_outside_the_window_are_stale_either_way() -> None:
    send_clock, recv_clock = Clock(), Clock()
    sealer = Sealer(SECRET, TO, clock=send_clock)
    opener = Opener(SECRET, TO, max_age_s=30.0, clock=recv_clock)
    old = sealer.seal(b"a")
    recv_clock.t += 30.5
    assert opener.open(old) is None
    send_clock.t += 61.0  # a sender 30.5 s ahead of the receiver
    assert opener.open(sealer.seal(b"b")) is None
    send_clock.t -= 1.0  # never decreases per stream: this one is 30.5 s ahead too
    assert opener.open(sealer.seal(b"c")) is None
    assert _drops(opener) == (0, 0, 3, 0)
    recv_clock.t += 30.5
    assert opener.open(sealer.seal(b"d")) == b"d"


def test_streams_are_independent_and_forgotten_only_once_replays_are_stale() -> None:
    clock = Clock()
    a, b = Sealer(SECRET, TO, clock=clock), Sealer(SECRET, TO, clock=clock)
    opener = Opener(SECRET, TO, max_age_s=10.0, clock=clock)
    a1, a2, b1 = a.seal(b"a1"), a.seal(b"a2"), b.seal(b"b1")
    assert opener.open(b1) == b"b1"
    assert opener.open(a2) == b"a2"
    assert opener.open(a1) is None  # older than the stream's newest: refused, not reordered
    assert opener.num_streams == 2
    clock.t += 10.001
    assert opener.open(Sealer(SECRET, TO, clock=clock).seal(b"c")) == b"c"  # purges a and b
    assert opener.num_streams == 1
    assert opener.open(a2) is None and opener.open(b1) is None  # forgotten, but stale
    assert _drops(opener) == (0, 0, 2, 1)


def test_secrets_are_checked_and_never_shown() -> None:
    with pytest.raises(ValueError, match=">= 16 bytes, got 8"):
        Sealer(b"12345678", TO)
    with pytest.raises(ValueError, match=">= 16 bytes, got str"):
        TransferConfig(secret="not bytes")  # type: ignore[arg-type]
    cfg = TransferConfig()
    assert len(cfg.secret) == 32 and cfg.secret != TransferConfig().secret
    assert cfg.secret.hex() not in repr(cfg) and repr(cfg.secret) not in repr(cfg)
    with pytest.raises(ValueError, match="not a host to dial"):
        TransferConfig(host="0.0.0.0")
