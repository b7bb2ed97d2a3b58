"""scripts/ray_head_monitor.py: a worker stops its Ray only once the head refuses connections
for the grace period (``ray down``), never while the head is unreachable (a network fault)."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest

from scripts.ray_head_monitor import REFUSED, UNREACHABLE, UP, follow, probe

pytestmark = pytest.mark.timeout(30)


def _replay(states: list[str]) -> tuple[Callable[[], str], list[float]]:
    """A check that answers ``states`` in turn (then raises: follow() must have returned)."""
    it, slept = iter(states), []

    def check() -> str:
        return next(it)

    return check, slept


def test_follow_returns_after_refusals_spanning_the_grace_period_only() -> None:
    check, slept = _replay([UP, REFUSED, REFUSED, UP, REFUSED, REFUSED, REFUSED, REFUSED])
    follow(check, grace_s=3.0, interval_s=1.0, sleep=slept.append)
    assert len(slept) == 7  # the refusal at the 4th look was cut short by an answer


def test_an_unreachable_head_never_stops_a_worker() -> None:
    check, slept = _replay([UNREACHABLE] * 50 + [REFUSED] * 4)
    follow(check, grace_s=3.0, interval_s=1.0, sleep=slept.append)
    assert len(slept) == 53  # only the refusals at the end counted


def test_probe_tells_a_listening_port_from_a_closed_one() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert probe("127.0.0.1", port) == UP
    assert probe("127.0.0.1", port) == REFUSED
