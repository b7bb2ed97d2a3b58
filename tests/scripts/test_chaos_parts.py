"""The chaos soak's parts that need no server: how a request is judged, how answers are read
off streams and raw sockets, the leak checks, the seeded schedule, and which processes it may
signal; the soak's own harm (a planted chunk, strangers' connections) on real directories
and sockets."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from pd.cache.disk_tier import DiskTier
from pdtools import chaos_faults
from pdtools.chaos_cluster import Interval, Metrics, Pools, ProcessTree, held_from
from pdtools.chaos_faults import Chaos
from pdtools.chaos_hostile import parse_raw
from pdtools.chaos_judge import Context, Tally, judge
from pdtools.chaos_lanes import lanes
from pdtools.chaos_load import Answer, Outcome, StreamReader, make_specs, stop_for
from pdtools.chaos_peers import hold_strangers
from pdtools.chaos_report import leak_checks, node_memory_check
from pdtools.disk_faults import plant_over, read_header

REF = Answer("Paris is the capital.", "stop", 6)


def _out(source: str = "steady", **kw: Any) -> Outcome:
    return Outcome("spec", source, kw.pop("start", 10.0), kw.pop("end", 11.0), **kw)


def _ctx(**kw: Any) -> Context:
    return Context(kw.get("doomed", {}), kw.get("pressure", []), kw.get("not_ready", []))


def test_a_request_is_ok_only_with_the_reference_answer_and_errors_only_with_a_cause() -> None:
    ok = _out(status=200, answer=REF, complete=True)
    assert judge(ok, REF, _ctx()).category == "ok"
    for wrong in (
        REF._replace(text="Paris is a city."),
        REF._replace(finish_reason="length"),
        REF._replace(num_tokens=7),
    ):
        assert judge(_out(status=200, answer=wrong, complete=True), REF, _ctx()).category == "wrong"
    # a stream cut on a node the soak killed before it ended: expected, if what came agrees
    cut = _out(
        status=200,
        answer=Answer("Paris is", None),
        error="internal error: node decode-1 failed: gone",
    )
    assert judge(cut, REF, _ctx(doomed={"decode-1": 10.5})).category == "expected"
    assert judge(cut, REF, _ctx(doomed={"decode-1": 11.5})).category == "unexpected"  # died after
    assert judge(cut, REF, _ctx(doomed={"decode-0": 10.5})).is_5xx  # another node: unexplained
    bad_prefix = _out(status=200, answer=Answer("London", None), error="node decode-1 failed")
    assert judge(bad_prefix, REF, _ctx(doomed={"decode-1": 10.5})).category == "wrong"
    died = _out(status=500, error="internal error: ClusterError('node prefill-2 failed: x')")
    assert judge(died, REF, _ctx(doomed={"prefill-2": 1.0})).category == "expected"
    # 429s: a flood's own, or the steady load's while admission was pressed (not after)
    assert judge(_out("flood", status=429), REF, _ctx()).category == "expected"
    assert judge(_out(status=429), REF, _ctx(pressure=[(9.0, 10.5)])).category == "expected"
    assert judge(_out(status=429), REF, _ctx(pressure=[(1.0, 5.0)])).category == "unexpected"
    assert judge(_out("slow_body", status=408), REF, _ctx()).category == "expected"
    assert judge(_out(status=408), REF, _ctx()).category == "unexpected"
    assert (
        judge(
            _out(status=503), REF, _ctx(not_ready=[Interval(10.5, 12, "no decode node")])
        ).category
        == "expected"
    )
    v = judge(_out(status=503), REF, _ctx())
    assert v.category == "unexpected" and v.is_5xx
    # a stalled stream the server cut (no error it could send) is expected; a steady one is not
    stalled = _out("stalled", status=200, answer=Answer("Paris", None))
    assert judge(stalled, REF, _ctx()).category == "expected"
    stalled_past_deadline = _out(
        "stalled", status=200, answer=Answer("Paris", None), code="request_timeout"
    )
    assert judge(stalled_past_deadline, REF, _ctx()).category == "expected"
    broken = _out("stalled", status=200, answer=Answer("Paris", None), code="server_error")
    assert judge(broken, REF, _ctx()) == ("unexpected", "stream ended early: server_error", True)
    assert (
        judge(_out(status=200, answer=Answer("Paris", None)), REF, _ctx()).category == "unexpected"
    )
    assert judge(_out(hang=True, error="no answer within 150 s"), REF, _ctx()).category == "hang"
    assert judge(_out(error="ConnectError: refused"), REF, _ctx()).category == "unexpected"
    assert (
        judge(_out("slow_body", error="ConnectionResetError"), REF, _ctx()).category == "expected"
    )


def test_tally_counts_by_source_and_keeps_examples_of_wrong_answers() -> None:
    tally, ctx = Tally(), _ctx()
    for out in [_out(status=200, answer=REF, complete=True)] * 3 + [
        _out(status=502),
        _out(status=200, answer=Answer("x", "stop", 1), complete=True),
    ]:
        tally.add(out, judge(out, REF, ctx))
    assert tally.counts["steady"] == {"sent": 5, "ok": 3, "unexpected": 1, "wrong": 1}
    assert tally.num_5xx == 1 and len(tally.examples) == 1 and "text 'x'" in tally.examples[0]
    assert tally.latency_in(0, 20) == "1.00 / 1.0 s (3)" and tally.latency_in(50, 60) == "-"


@pytest.mark.parametrize(
    "endpoint, events, answer",
    [
        ("chat", ['{"choices":[{"delta":{"role":"assistant","content":""}}]}', '{"choices":[{"delta":{"content":"Hi"},"finish_reason":null}]}', '{"choices":[{"delta":{},"finish_reason":"stop"}]}', '{"choices":[],"usage":{"completion_tokens":2}}'], Answer("Hi", "stop", 2)),
        ("completions", ['{"choices":[{"text":" a","finish_reason":null}]}', '{"choices":[{"text":" b","finish_reason":"length"}]}', '{"choices":[],"usage":{"completion_tokens":2}}'], Answer(" a b", "length", 2)),
        ("generate", ['{"text":"x","output_ids":[5],"finish_reason":null,"completion_tokens":1}', '{"text":"y","output_ids":[6],"finish_reason":"stop","completion_tokens":2}'], Answer("xy", "stop", 2, (5, 6))),
    ],
)  # fmt: skip
def test_streams_of_every_endpoint_read_to_their_answer(
    endpoint: str, events: list[str], answer: Answer
) -> None:
    reader = StreamReader(endpoint)
    for event in events:
        reader.feed(f"data: {event}")
    assert not reader.done and reader.answer() == answer
    reader.feed(
        'data: {"error": {"message": "node decode-0 failed", "code": null, "type": "server_error"}}'
    )
    reader.feed("data: [DONE]")
    assert reader.done and reader.error == "node decode-0 failed" and reader.code == "server_error"
    assert Answer(answer.text[:1], None).is_prefix_of(answer)
    assert not Answer("z", None).is_prefix_of(answer)


def test_raw_responses_are_read_whole_or_marked_cut_short() -> None:
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    whole = parse_raw(head + b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n", "")
    assert whole == (200, b"hello world", True, "")
    cut = parse_raw(head + b"5\r\nhello\r\n6\r\n wo", "")
    assert cut.status == 200 and cut.body == b"hello wo" and not cut.complete
    sized = parse_raw(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 4\r\n\r\nslow", "")
    assert sized == (408, b"slow", True, "")
    assert parse_raw(b"", "ConnectionResetError").status is None


def test_stop_strings_come_from_the_answer_past_its_start() -> None:
    text = "The capital of France is Paris, a city on the Seine."
    stop = stop_for(text)
    assert stop is not None and stop in text[4:] and len(stop) == 3
    assert stop_for("ok") is None and stop_for("") is None


def test_metrics_are_parsed_by_name_and_labels() -> None:
    text = "\n".join([
        "# HELP pd_failed_nodes Nodes found dead",
        "pd_failed_nodes 2.0",
        'pd_node_pending_transfers{node="prefill-0",role="prefill"} 0.0',
        'pd_node_pending_transfers{node="decode-1",role="decode"} 3.0',
    ])  # fmt: skip
    m = Metrics.parse(text)
    assert m.value("pd_failed_nodes") == 2 and m.total("pd_node_pending_transfers") == 3
    assert m.value("pd_node_pending_transfers", node="decode-1", role="decode") == 3
    assert m.by("pd_node_pending_transfers", "node") == {"prefill-0": 0.0, "decode-1": 3.0}


def _node(node_id: str, **kw: Any) -> dict[str, Any]:
    base = dict(id=node_id, role=node_id.split("-")[0], state="ready", load=0, queued_tokens=0, slots_in_use=0, pair_groups=2, sockets=7, threads=7)  # fmt: skip
    return {**base, **kw}


def test_leak_checks_pass_at_idle_and_name_what_is_held() -> None:
    sizes, idle = {"prefill": 2, "decode": 2}, {"prefill": 3, "decode": 3}
    nodes = [_node("prefill-0"), _node("prefill-3"), _node("decode-1"), _node("decode-2")]
    metrics = Metrics.parse("pd_server_admitted_requests 0\npd_server_queued_requests 0")
    assert all(c.ok for c in leak_checks(Pools(sizes, nodes), metrics, sizes, idle))
    leaky = [
        _node("prefill-0", slots_in_use=12, threads=10),
        _node("prefill-3", pair_groups=7),  # 4 nodes: at most 2 x 3 (each way, each peer)
        _node("decode-1"),
        _node("decode-2", state="draining"),
    ]
    held = Metrics.parse("pd_server_admitted_requests 1\npd_server_queued_requests 0")
    failed = {
        c.name: c.measured for c in leak_checks(Pools(sizes, leaky), held, sizes, idle) if not c.ok
    }
    assert failed.keys() == {
        "pools whole (ready nodes / size, none starting or draining)",
        "KV slots held by requests (all nodes)",
        "pair groups per node",
        "threads per node beyond 2 per pair group",
        "admission places held, queued; server and coordinator in flight",
    }, failed  # fmt: skip
    assert (
        failed["pair groups per node"] == "prefill-3: 7"
        and failed["KV slots held by requests (all nodes)"] == "12"
    )


def test_each_lane_runs_rounds_of_its_faults_in_a_seeded_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(chaos_faults, "GAP_S", (0.0, 0.0))
    node_faults = lanes()["nodes"]

    def schedule(seed: int, num_faults: int) -> list[str]:
        chaos, ran = Chaos.__new__(Chaos), []

        async def run(name: str, rng: random.Random) -> None:
            ran.append(name)
            if len(ran) == num_faults:
                raise asyncio.CancelledError  # the lane's end, for this test

        chaos.run = run  # type: ignore[method-assign]
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(chaos.lane(node_faults, float("inf"), random.Random(seed)))
        return ran

    first = schedule(0, 2 * len(node_faults))
    assert first == schedule(0, 2 * len(node_faults)) != schedule(1, 2 * len(node_faults))
    n = len(node_faults)
    assert sorted(first[:n]) == sorted(first[n:]) == sorted(node_faults)  # each once a round


def test_every_fault_is_registered_once_and_every_list_is_read_off_the_registry() -> None:
    from pdtools.chaos_faults import FAULTS, fault
    from pdtools.chaos_report import SOURCES
    from scripts.chaos_soak import parse_args

    every = lanes(tp=2, disk=True, tpm=True)
    assert sorted(n for names in every.values() for n in names) == sorted(FAULTS)
    assert lanes()["nodes"] == (
        "kill-prefill",
        "kill-decode",
        "freeze-short",
        "freeze-long",
        "drain",
    )
    assert set(every["nodes"]) - set(lanes()["nodes"]) == {
        "kill-rank",
        "freeze-rank",
        "planted-chunk",
    }
    assert lanes(only=["flood", "drain"]) == {"nodes": ("drain",), "traffic": ("flood",)}
    assert {f.source for f in FAULTS.values() if f.source} | {"steady"} == set(SOURCES)
    assert parse_args(["--faults", "junk-frames"]).faults == ["junk-frames"]
    with pytest.raises(SystemExit):
        parse_args(["--faults", "no-such-fault"])
    with pytest.raises(AssertionError, match="registered twice"):
        fault("drain", "nodes")(FAULTS["drain"].run)


def test_only_the_server_and_its_descendants_may_be_signalled() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mine = ProcessTree(os.getpid())
        assert mine.owns(child.pid) and mine.owns(os.getpid())
        assert not ProcessTree(child.pid).owns(os.getpid())  # not a descendant of it
        assert not ProcessTree(None).owns(child.pid)  # attached without --server-pid: none
        assert not mine.owns(1) and not mine.owns(2**22 + 7)  # init; no such process
    finally:
        child.kill()
        child.wait()
    assert not ProcessTree(os.getpid()).signal(child.pid, 0)  # gone: never signalled


def test_a_stream_gives_its_request_id_and_cached_tokens() -> None:
    reader = StreamReader("chat")
    reader.feed('data: {"id": "chatcmpl-7", "choices": [{"delta": {"content": "Hi"}}]}')
    reader.feed(
        'data: {"id": "chatcmpl-7", "choices": [], "usage": {"completion_tokens": 1, '
        '"prompt_tokens_details": {"cached_tokens": 96}}}'
    )
    assert (reader.request_id, reader.cached_tokens) == ("chatcmpl-7", 96)


def test_the_soak_starts_pd_serve_at_its_defaults_or_as_asked() -> None:
    import argparse

    from scripts.chaos_soak import engine_args, parse_args

    assert engine_args(parse_args([])) == []  # pd serve's own defaults
    assert engine_args(parse_args(["--engine", "eager"])) == ["--compile-buckets", "off"]
    args = parse_args(["--engine", "fp32-eager", "--speculative-tokens", "4"])
    assert engine_args(args) == [
        "--quantization", "none", "--compile-buckets", "off", "--speculative-tokens", "4",
    ]  # fmt: skip
    assert isinstance(args, argparse.Namespace)


def test_a_wrong_answer_is_reported_with_the_path_that_served_it() -> None:
    from pdtools.chaos_report import _path, wrong_paths

    class _Chaos:
        records = [chaos_faults.FaultRecord("drain", 50.0, 55.0, "decode-1")]
        doomed: dict[str, float] = {}

        def pressure_windows(self) -> list[Interval]:
            return []

    class _Monitor:
        not_ready: list[Interval] = []

    wrong = _out(status=200, answer=Answer("x", "stop", 1), complete=True, start=60.0,
                 request_id="cmpl-9", cached_tokens=64)  # fmt: skip
    right = _out(status=200, answer=REF, complete=True, request_id="cmpl-8")
    route = {"request_id": "cmpl-9", "at": 0.0, "prefill": "prefill-0", "decode": "decode-0",
             "num_matched": 64, "pull_from": "decode-1", "num_pulled": 64}  # fmt: skip

    class _Run(NamedTuple):
        chaos: Any = _Chaos()
        monitor: Any = _Monitor()
        refs: Any = type("R", (), {"answers": {"spec": REF}})()
        outcomes: list[Outcome] = [right, wrong]  # noqa: RUF012
        origin: float = 0.0
        routes: dict[str, Any] = {"cmpl-9": [route]}  # noqa: RUF012

    (row,) = wrong_paths(_Run())  # type: ignore[arg-type]
    assert row["id"] == "cmpl-9" and row["cached_tokens"] == 64
    assert row["last_fault"] == "drain decode-1 at t=50 s"
    assert _path(row["attempts"][0]) == (
        "prefill-0 -> decode-0, 64 expected cached, pulled 64 from decode-1"
    )


def test_a_planted_chunk_is_refused_by_a_node_starting_on_the_directory(tmp_path: Path) -> None:
    """The soak's ``planted-chunk``: a real chunk replaced by a forgery of the same name,
    header and payload checksum under another key; a node's tier starting on the directory
    refuses and removes it, and a read finds nothing."""
    tokens = list(range(8))
    writer = DiskTier(tmp_path, "model-a", 8, 2**30)
    writer.write("", tokens, b"the real kv" * 100)
    writer.flush()
    writer.close()
    (file,) = (tmp_path / "model-a").glob("*.kv")
    forged = plant_over(file, seed=3)
    assert file.read_bytes() == forged and read_header(file).tokens == tokens
    node = DiskTier(tmp_path, "model-a", 8, 2**30)
    assert node.scan() == [] and node.stats.num_rejected == 1 and not file.exists()
    assert node.read("", tokens) is None
    node.close()


def test_strangers_connect_send_junk_and_close() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        server.settimeout(5)
        mine, num_junk, refused = hold_strangers([port], 9, 0.1, seed=1)
        assert (len(mine), num_junk, refused) == (9, 3, 0)
        conns = [server.accept()[0] for _ in range(9)]
        assert {c.getpeername()[1] for c in conns} == mine
        assert sum(held_from(os.getpid(), mine).values()) == 9  # held until closed
        got = []
        for conn in conns:
            with conn:
                conn.settimeout(5)
                data = b""
                while chunk := conn.recv(4096):  # all it sent, then its end (b"")
                    data += chunk
                got.append(data)
        assert sum(1 for d in got if d) == 3 and held_from(os.getpid(), mine) == {}


def test_a_strangers_port_pair_taken_again_by_a_live_client_is_not_held() -> None:
    """Loopback reuses a port pair in TIME_WAIT at once: once the strangers closed theirs, a
    node's connection from a port a stranger had that is still ESTABLISHED is a new client's;
    one its client closed (CLOSE_WAIT) is held."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(5)
        client = socket.create_connection(server.getsockname(), timeout=5)
        conn, _ = server.accept()
        with conn:
            peer = {client.getsockname()[1]}
            mine = server.getsockname()[1]
            assert held_from(os.getpid(), peer) == {(mine, "ESTABLISHED"): 1}
            assert held_from(os.getpid(), peer, closed=True) == {}  # a client's, alive
            client.close()
            time.sleep(0.1)
            assert held_from(os.getpid(), peer, closed=True) == {(mine, "CLOSE_WAIT"): 1}


def test_requests_without_max_tokens_are_in_the_load() -> None:
    nomax = [s for s in make_specs() if s.no_max_tokens]
    assert {s.endpoint for s in nomax} == {"chat", "completions"}
    assert all("max_tokens" not in s.request_body() for s in nomax)


def test_node_memory_is_judged_over_the_second_half_of_each_life() -> None:
    warm = [(t, 100.0 + (200.0 if t >= 10 else 0.0)) for t in range(0, 121, 5)]  # warms up
    leak = [(t, 100.0 + t) for t in range(0, 121, 5)]  # grows all its life
    short = [(0.0, 100.0), (30.0, 900.0)]  # too short-lived to judge
    # an answer in flight (+200) in each half, the midpoint between them: no growth
    busy = [(t, 100.0 + (200.0 if 20 <= t <= 40 or t >= 115 else 0.0)) for t in range(0, 121, 5)]
    assert node_memory_check({"a": warm, "s": short, "c": busy}, 96.0).ok
    check = node_memory_check({"a": warm, "b": leak}, 50.0)
    assert not check.ok and "b 160 -> 220" in check.measured
