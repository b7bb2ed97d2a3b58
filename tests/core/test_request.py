"""A request's status moves only along ``ALLOWED_TRANSITIONS``."""

from __future__ import annotations

import pytest

from pd.core.request import ALLOWED_TRANSITIONS, InvalidTransition, Req, ReqStatus
from pd.core.sampling_params import SamplingParams


def _req() -> Req:
    return Req("r", [1, 2, 3], SamplingParams(max_tokens=4))


def test_the_roles_paths_are_allowed() -> None:
    paths = {
        "colocated": [ReqStatus.WAITING, ReqStatus.RUNNING, ReqStatus.WAITING, ReqStatus.RUNNING],
        "prefill": [ReqStatus.WAITING, ReqStatus.RUNNING, ReqStatus.SENDING],
        "decode": [ReqStatus.EXPECTED, ReqStatus.INCOMING, ReqStatus.RUNNING],
        "aborted while its KV lands": [
            ReqStatus.EXPECTED, ReqStatus.INCOMING, ReqStatus.RELEASING,
        ],
    }  # fmt: skip
    for name, path in paths.items():
        req = _req()
        for status in path:
            req.set_status(status)
        req.finish("stop")
        assert req.is_finished and req.finish_reason == "stop", name


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        ([], ReqStatus.RUNNING),  # admitted without being queued
        ([ReqStatus.WAITING], ReqStatus.SENDING),  # sent before it ran
        ([ReqStatus.EXPECTED], ReqStatus.RUNNING),  # decoding KV that never came
        ([ReqStatus.WAITING, ReqStatus.RUNNING, ReqStatus.SENDING], ReqStatus.RUNNING),
        ([ReqStatus.FINISHED], ReqStatus.WAITING),  # nothing leaves FINISHED
    ],
)
def test_a_move_the_table_does_not_list_raises(path: list[ReqStatus], bad: ReqStatus) -> None:
    req = _req()
    for status in path:
        req.set_status(status)
    before = req.status
    with pytest.raises(InvalidTransition, match=f"'r': {before.name} -> {bad.name}"):
        req.set_status(bad)
    assert req.status is before, "a refused move changes nothing"


def test_every_status_has_a_row_and_only_finished_is_final() -> None:
    assert set(ALLOWED_TRANSITIONS) == set(ReqStatus)
    final = [s for s, nxt in ALLOWED_TRANSITIONS.items() if not nxt]
    assert final == [ReqStatus.FINISHED]
    assert all(ReqStatus.FINISHED in nxt for s, nxt in ALLOWED_TRANSITIONS.items() if nxt)
