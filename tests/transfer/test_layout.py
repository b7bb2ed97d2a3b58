"""The wire plan: which order and pieces a transfer's rows take, and that every plan moves
each token's rows into its own destination slot (fake and gloo pairs, through the agent)."""

from __future__ import annotations

import pytest
import torch

from tests.transfer.helpers import (
    assert_moved,
    assert_untouched,
    make_pool,
    run_until,
)
from tests.transfer.test_agent import _both_final, _make_pair
from transfer.agent import TransferAgent
from transfer.layout import MAX_SEGMENTS, in_wire_order, plan_wire, run_firsts
from transfer.state import CallbackSlotOwner, KVPoll, TransferConfig

pytestmark = pytest.mark.timeout(30)


def _t(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def _staged_sides(src: list[int], dst: list[int]) -> int:
    plan = plan_wire(_t(src), _t(dst))
    assert sum(plan.segments) == len(src) and min(plan.segments) >= 1
    assert len(plan.segments) <= MAX_SEGMENTS
    d = _t(dst)
    sides = [in_wire_order(_t(src), d, plan.by_dst), in_wire_order(d, d, plan.by_dst)]
    return sum(run_firsts(s, plan.segments) is None for s in sides)


def test_plan_copies_only_where_slots_are_scattered() -> None:
    run = list(range(10, 30))
    assert plan_wire(_t(run), _t(list(range(5, 25)))).segments == [20]
    # A run handed out in shuffled order: sorted by destination, both sides are runs again.
    shuffled = torch.randperm(20, generator=torch.Generator().manual_seed(0)).tolist()
    assert _staged_sides([run[i] for i in shuffled], [40 + i for i in shuffled]) == 0
    # One side permuted against the other: one side must copy, never both.
    assert _staged_sides([run[i] for i in shuffled], [40 + i for i in range(20)]) == 1
    assert _staged_sides(run, [40 + i for i in shuffled]) == 1
    # A cached prefix elsewhere + new slots (two source runs) -> a fresh run: two pieces.
    plan = plan_wire(_t([50, 51, 52, 3, 4, 5, 6]), _t(list(range(7))))
    assert plan.segments == [3, 4] and _staged_sides([50, 51, 52, 3, 4, 5, 6], list(range(7))) == 0
    # Random on both sides: one piece, both stage.
    gen = torch.Generator().manual_seed(1)
    src, dst = (torch.randperm(200, generator=gen)[:64].tolist() for _ in range(2))
    assert plan_wire(_t(src), _t(dst)).segments == [64]
    assert _staged_sides(src, dst) == 2
    # Random source, few destination runs: the receiver still takes views.
    assert _staged_sides(src, list(range(0, 32)) + list(range(100, 132))) == 1


def test_run_firsts() -> None:
    assert run_firsts(_t([4, 5, 9, 10, 11]), [2, 3]) == [4, 9]
    assert run_firsts(_t([4, 5, 9, 10, 11]), [5]) is None
    assert run_firsts(_t([4, 6]), [1, 1]) == [4, 6]
    with pytest.raises(ValueError):
        run_firsts(_t([1, 2]), [3])


@pytest.mark.parametrize("backend", ["fake", "gloo"])
def test_every_plan_moves_rows_to_their_own_slots(backend: str) -> None:
    s, r, owner = _make_pair(backend)
    try:
        cases = {  # source slots of 8 tokens; the receiver hands out 0..7, 8..15, ...
            "runs": [40, 41, 42, 43, 3, 4, 5, 6],  # two source runs -> views on both sides
            "run": list(range(20, 28)),
            "scattered": [63, 1, 30, 12, 50, 9, 33, 2],
        }
        for tid, slots in cases.items():
            snd, rcv = s.sender(tid, r.endpoint, 8), r.receiver(tid)
            snd.send(slots)
            assert run_until(lambda snd=snd, rcv=rcv: _both_final(snd, rcv), [s, r], 15)
            assert rcv.poll() == KVPoll.SUCCESS, rcv.failure
            assert_moved(s.pool, slots, r.pool, rcv.slots)  # type: ignore[attr-defined]
        assert_untouched(r.pool, list(range(24)))  # type: ignore[attr-defined]
        owner.check()
    finally:
        s.close()
        r.close()


def test_scattered_destination_in_random_order() -> None:
    """A receiver whose allocator hands out a shuffled set of slots (plan: sort by them)."""
    cfg = TransferConfig(backend="fake", handshake_timeout_s=2.0, timeout_s=2.0)
    src, dst = make_pool(seed=4), make_pool(seed=None)
    given = [[17, 9, 10, 8, 11, 16, 18, 12], [60, 2, 44, 31, 5, 59, 23, 40]]
    owner = CallbackSlotOwner(lambda n: given.pop(0), lambda slots: None)
    s = TransferAgent(cfg, src.k + src.v, src.num_layers)
    r = TransferAgent(cfg, dst.k + dst.v, dst.num_layers, owner)
    try:
        for tid, slots in (("a", list(range(30, 38))), ("b", [7, 3, 1, 62, 20, 21, 22, 0])):
            snd, rcv = s.sender(tid, r.endpoint, 8), r.receiver(tid)
            snd.send(slots)
            assert run_until(lambda snd=snd, rcv=rcv: _both_final(snd, rcv), [s, r], 10)
            assert rcv.poll() == KVPoll.SUCCESS, rcv.failure
            assert_moved(src, slots, dst, rcv.slots)
    finally:
        s.close()
        r.close()


def test_a_start_with_a_bad_plan_fails_the_transfer_and_frees_its_slots() -> None:
    from transfer.messages import TransferStartMsg

    s, r, owner = _make_pair()
    try:
        snd, rcv = s.sender("t", r.endpoint, 4), r.receiver("t")
        assert run_until(lambda: snd.poll() == KVPoll.WAITING, [s, r], 5)
        rec = s._sender.records["t"]  # forge the start the sender would send, with a bad plan
        s._ctrl.send(
            r.endpoint,
            TransferStartMsg(
                transfer_id="t", seq=0, group_prefix=rec.prefix, by_dst=True, segments=[3, 3]
            ),
        )
        assert run_until(lambda: rcv.poll() == KVPoll.FAILED, [s, r], 5)
        assert "wire plan" in (rcv.failure or "") and owner.released == ["t"]
        assert owner.alloc.num_free_slots == 64
    finally:
        s.close()
        r.close()
