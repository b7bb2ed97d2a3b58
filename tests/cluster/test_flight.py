"""``Flight``'s status: the moves it allows, and the one it refuses."""

from __future__ import annotations

import pytest

from pd.cluster.flight import ALLOWED, Attempt, Flight, FlightStatus
from pd.core.sampling_params import SamplingParams

S = FlightStatus


def _make_flight() -> Flight:
    return Flight("r", [1, 2, 3], SamplingParams(max_tokens=4), "")


def test_a_rerouted_flight_streams_under_its_second_wire_id_and_finishes() -> None:
    f = _make_flight()
    assert f.begin_attempt() == "r" and f.status is S.WAITING
    f.route(None, "decode-0")  # the decode node prefills it
    assert (f.prefill, f.decode, f.status) == ("", "decode-0", S.ROUTED)
    f.set_status(S.RETRY_PENDING)
    assert f.can_reroute(max_reroutes=1)
    assert f.end_attempt(S.REROUTING) == Attempt("r", "", "decode-0")
    assert f.begin_attempt() == "r~1" and f.num_attempts == 2
    f.route("prefill-1", "decode-0")
    assert not f.can_reroute(max_reroutes=1)  # its one re-route is spent
    f.receive([])
    assert f.status is S.ROUTED  # nothing came back yet
    f.receive([5, 6])
    assert f.status is S.STREAMING and f.num_received == 2
    assert f.end_attempt(S.FINISHED) == Attempt("r~1", "prefill-1", "decode-0")
    assert f.is_over and (f.prefill, f.decode, f.last_prefill) == ("", "", "prefill-1")
    assert f.out_of_reroutes("x") == "x (re-routed 1 time(s) before: no more)"


def test_an_illegal_move_raises_and_leaves_the_status() -> None:
    f = _make_flight()
    f.begin_attempt()
    f.route("prefill-0", "decode-0")
    f.receive([7])
    with pytest.raises(AssertionError, match="r: STREAMING -> ROUTED is not allowed"):
        f.set_status(S.ROUTED)  # tokens reached the caller: a new attempt only by REROUTING
    assert f.status is S.STREAMING
    f.end_attempt(S.ABORTED)
    with pytest.raises(AssertionError, match="ABORTED -> FAILED"):
        f.end_attempt(S.FAILED)  # over is over


def test_a_started_flight_fails_over_from_its_output_a_bounded_number_of_times() -> None:
    f = _make_flight()  # max_tokens 4
    f.begin_attempt()
    f.route("prefill-0", "decode-0")
    assert f.can_fail_over(max_failovers=2)  # (nothing streamed: once its re-routes are spent)
    f.receive([7, 8])
    assert f.can_fail_over(max_failovers=2) and not f.can_fail_over(max_failovers=0)
    f.end_attempt(S.REROUTING)  # its decode node died
    f.num_failovers += 1
    assert f.begin_attempt() == "r~1" and f.num_attempt_tokens == 2  # offsets go on from 2
    f.route(None, "decode-1")
    f.receive([9])
    assert f.output_ids == [7, 8, 9] and f.num_received == 3
    assert f.can_fail_over(max_failovers=2) and not f.can_fail_over(max_failovers=1)
    f.receive([10])  # max_tokens reached: nothing is left to resume
    assert not f.can_fail_over(max_failovers=2)


def test_a_flight_aborted_between_attempts_gives_up_none() -> None:
    f = _make_flight()
    f.begin_attempt()
    f.route("prefill-0", "decode-0")
    f.end_attempt(S.REROUTING)
    assert not f.holds_attempt and f.end_attempt(S.ABORTED) is None


def test_every_status_not_over_may_fail_or_be_aborted() -> None:
    for status, after in ALLOWED.items():
        is_over = status in (S.FINISHED, S.FAILED, S.ABORTED)
        assert (after == frozenset()) == is_over, status
        assert is_over or {S.FAILED, S.ABORTED} <= after, status
