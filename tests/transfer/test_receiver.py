"""The receive record's status: the steps it allows and what ``poll()`` shows of each."""

from __future__ import annotations

import pytest

from transfer.recv_record import RecvRecord, RecvStatus
from transfer.state import KVPoll


def test_failing_polls_as_failed_and_only_moves_to_failed() -> None:
    rec = RecvRecord("t")
    for status in (RecvStatus.WAITING, RecvStatus.TRANSFERRING, RecvStatus.FAILING):
        rec.move_to(status)
    assert rec.state == KVPoll.FAILED and rec.state.is_final
    with pytest.raises(AssertionError, match="FAILING -> SUCCESS"):
        rec.move_to(RecvStatus.SUCCESS)
    rec.move_to(RecvStatus.FAILED)
    assert rec.state == KVPoll.FAILED


def test_final_statuses_do_not_move() -> None:
    for final in (RecvStatus.SUCCESS, RecvStatus.FAILED):
        rec = RecvRecord("t", status=final)
        assert rec.state.name == final.name
        with pytest.raises(AssertionError):  # a second release would be a double free
            rec.move_to(RecvStatus.FAILED)


def test_a_start_before_the_request_is_refused() -> None:
    rec = RecvRecord("t")
    assert rec.state == KVPoll.BOOTSTRAPPING
    with pytest.raises(AssertionError, match="BOOTSTRAPPING -> TRANSFERRING"):
        rec.move_to(RecvStatus.TRANSFERRING)
