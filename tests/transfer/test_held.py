"""A transfer request that reaches the receiver before its slot owner knows the id is held, not
refused (``BaseSlotOwner.knows``): answered as soon as the owner knows it, without a retry;
bounded in count and in age; and it leaves nothing behind when either side gives up."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.transfer.helpers import TrackingOwner, assert_moved, buffers, make_pool, run_until
from transfer.agent import TransferAgent
from transfer.state import KVPoll, TransferConfig

pytestmark = pytest.mark.timeout(30)

FAST = dict(handshake_timeout_s=2.0, timeout_s=2.0, connect_timeout_s=5.0, retry_interval_s=0.01)

Pair = tuple[TransferAgent, TransferAgent, "LateOwner"]


class LateOwner(TrackingOwner):
    """Knows only the ids in ``known`` (as a decode node knows only the requests the server
    announced), and records each landing."""

    def __init__(self) -> None:
        super().__init__()
        self.known: set[str] = set()
        self.landed_ids: list[str] = []

    def knows(self, transfer_id: str) -> bool:
        return transfer_id in self.known

    def landed(self, transfer_id: str) -> None:
        self.landed_ids.append(transfer_id)


@pytest.fixture
def make_pair() -> Iterator[object]:
    made: list[TransferAgent] = []

    def make(**overrides: float) -> Pair:
        cfg = TransferConfig(backend="fake", **{**FAST, **overrides})  # type: ignore[arg-type]
        src, dst = make_pool(seed=1), make_pool(seed=None)
        owner = LateOwner()
        s = TransferAgent(cfg, buffers(src), src.num_layers)
        r = TransferAgent(cfg, buffers(dst), dst.num_layers, owner)
        s.pool, r.pool = src, dst  # type: ignore[attr-defined]
        made.extend((s, r))
        return s, r, owner

    yield make
    for agent in made:
        agent.close()


def test_a_request_before_its_id_is_known_is_held_and_served_without_a_retry(make_pair) -> None:
    s, r, owner = make_pair()
    snd = s.sender("t", r.endpoint, 4)
    snd.send([1, 2, 3, 4])
    assert run_until(lambda: r.num_held_requests == 1, [s, r], 5)
    run_until(lambda: False, [s, r], 0.2)  # held, not refused: the sender is not asked to retry
    assert snd.poll() == KVPoll.BOOTSTRAPPING and r.poll("t") == KVPoll.BOOTSTRAPPING
    assert owner.reserved == {} and s.num_retries == 0
    owner.known.add("t")
    r.answer_held("t")  # at once, not at the next progress()
    assert list(owner.reserved) == ["t"]
    assert run_until(lambda: snd.poll().is_final, [s, r], 5)
    assert snd.poll() == KVPoll.SUCCESS, snd.failure
    assert s.num_retries == 0 and r.num_held_requests == 1 and owner.landed_ids == ["t"]
    assert_moved(s.pool, [1, 2, 3, 4], r.pool, r.receiver("t").slots)  # type: ignore[attr-defined]


def test_held_requests_are_bounded_in_count_and_in_age(make_pair) -> None:
    s, r, owner = make_pair(max_held_requests=1)  # each held half of handshake_timeout_s: 1 s
    senders = [s.sender(t, r.endpoint, 2) for t in ("first", "second")]
    for i, snd in enumerate(senders):
        snd.send([2 * i, 2 * i + 1])
    t0 = time.monotonic()
    # one is held; the other is answered "no room" and asks again and again
    assert run_until(lambda: r.num_held_requests == 1 and s.num_retries >= 3, [s, r], 5)
    # past its age the held one is answered "no room" too, and the next request is held
    assert run_until(lambda: r.num_held_requests == 2, [s, r], 5)
    assert 1.0 <= time.monotonic() - t0 < 1.8
    assert all(snd.poll() == KVPoll.BOOTSTRAPPING for snd in senders), "none gave up"
    owner.known |= {"first", "second"}
    assert run_until(lambda: all(snd.poll().is_final for snd in senders), [s, r], 5)
    assert [snd.poll() for snd in senders] == [KVPoll.SUCCESS] * 2, [x.failure for x in senders]
    owner.check()


def test_a_held_request_given_up_by_either_side_leaves_nothing(make_pair) -> None:
    s, r, owner = make_pair()
    by_sender, by_owner = s.sender("a", r.endpoint, 3), s.sender("b", r.endpoint, 3)
    assert run_until(lambda: r.num_held_requests == 2, [s, r], 5)
    by_sender.abort("the client went away")
    r.receiver("b").abort("the request was aborted")  # the owner gives it up: the sender hears
    assert run_until(lambda: r.poll("a") == KVPoll.FAILED and by_owner.poll().is_final, [s, r], 5)
    assert "the request was aborted" in (by_owner.failure or "")
    assert r.num_open_transfers == s.num_open_transfers == 0
    assert owner.reserved == {} and owner.released == [] and s.num_retries == 0
