"""The hostile tenant's lane of the chaos soak (``pdtools.chaos_tenant``) without a cluster: its
requests are what they claim (a schema just within the server's character bound that compiles,
fields one past it, traps that compile), its faults are registered in their lane, and the
``/health`` check judges the 99th percentile. The lane itself runs in
``tests/scripts/test_chaos_soak.py``."""

from __future__ import annotations

import json

import pytest

from pd.server.http.errors import APIError
from pd.server.openai.structured import MAX_GRAMMAR_CHARS, grammar_of
from pdtools.chaos_lanes import lanes
from pdtools.chaos_report import health_check
from pdtools.chaos_tenant_http import big_schema, json_schema


def test_the_big_schema_is_just_within_the_bound_and_compiles() -> None:
    schema = big_schema(MAX_GRAMMAR_CHARS - 64)
    size = len(json.dumps(json_schema(schema)))
    assert MAX_GRAMMAR_CHARS - 1000 < size <= MAX_GRAMMAR_CHARS, size
    assert grammar_of({"response_format": json_schema(schema)})
    past = json_schema({"type": "object", "description": "x" * (MAX_GRAMMAR_CHARS + 1)})
    with pytest.raises(APIError, match=f"at most {MAX_GRAMMAR_CHARS}"):
        grammar_of({"response_format": past})


def test_the_tenant_lane_holds_its_faults_and_tpm_needs_a_limit() -> None:
    assert lanes()["tenant"] == (
        "tool-call-traps", "big-schema", "limit-edges", "stopped-readers", "logprobs-answer",
        "pair-strangers",
    )  # fmt: skip
    assert "tpm-no-max" in lanes(tpm=True)["tenant"]


def test_health_p99_is_judged_against_its_bound() -> None:
    fast = [(float(t), 0.01) for t in range(199)]
    assert health_check(fast + [(199.0, 0.3)], 250).ok  # one slow probe of 200: the p99 holds
    slow = fast + [(float(t), 0.3) for t in range(200, 203)]
    check = health_check(slow, 250)
    assert not check.ok and "p99 300" in check.measured, check
    assert not health_check([], 250).ok


def test_a_hostile_request_failed_only_by_a_node_the_soak_killed_is_not_a_failure() -> None:
    from types import SimpleNamespace

    from pdtools.chaos_faults import FaultRecord
    from pdtools.chaos_tenant import _judged
    from pdtools.chaos_tenant_http import Reply

    chaos = SimpleNamespace(doomed={"decode-0": 0.0})
    rec = FaultRecord("logprobs-answer", 0.0)
    for node in ("decode-0", "decode-3"):  # killed by the soak; found dead unasked
        reply = Reply()
        reply.status, reply.error = 500, f"internal error: ClusterError('node {node} failed: x')"
        _judged(chaos, rec, reply, "got 500", "want the whole answer")  # type: ignore[arg-type]
    assert rec.failures == ["want the whole answer, got 500"]
    assert rec.notes == [
        "want the whole answer: its node decode-0 was killed or frozen by the soak"
    ]


def test_a_hostile_request_refused_while_admission_is_full_or_timed_out_is_noted() -> None:
    from types import SimpleNamespace

    from pdtools.chaos_faults import FaultRecord
    from pdtools.chaos_tenant import _judged
    from pdtools.chaos_tenant_http import Reply

    rec = FaultRecord("logprobs-answer", 0.0)
    for status, code in (
        (429, "server_overloaded"),
        (504, "request_timeout"),
        (429, "rate_limit_exceeded"),
    ):
        reply = Reply()
        reply.status, reply.code, reply.error = status, code, "server overloaded"
        _judged(SimpleNamespace(doomed={}), rec, reply, f"got {status}", "want it")  # type: ignore[arg-type]
    assert rec.failures == ["want it, got 429"]  # a key's own limit is no excuse
    assert len(rec.notes) == 2 and "admission was full" in rec.notes[0], rec.notes
    assert "request deadline" in rec.notes[1], rec.notes
