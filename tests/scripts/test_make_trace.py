"""pdtools/trace.py and scripts/make_trace.py: the Mooncake trace format, and the synthesizer's shared prefixes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pdtools.trace import BLOCK_SIZE, TraceRequest, read_trace, write_trace
from scripts.make_trace import TraceConfig, main, synthesize

_FIELDS = ["timestamp", "input_length", "output_length", "hash_ids"]


@pytest.mark.timeout(30)
def test_written_trace_has_exactly_mooncakes_fields(tmp_path: Path) -> None:
    out = tmp_path / "trace.jsonl"
    assert main(["--out", str(out), "--num-sessions", "5", "--seed", "3"]) == 0
    lines = out.read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) >= 5
    for row in rows:
        assert list(row) == _FIELDS
        assert all(type(row[k]) is int for k in _FIELDS[:3])
        assert all(type(h) is int for h in row["hash_ids"])
        assert len(row["hash_ids"]) == math.ceil(row["input_length"] / BLOCK_SIZE)
        assert row["hash_ids"][0] == 0  # as in every request of Mooncake's conversation trace
    assert [r.timestamp for r in read_trace(out)] == [row["timestamp"] for row in rows]
    assert rows == sorted(rows, key=lambda r: r["timestamp"])


def test_read_trace_rejects_a_wrong_number_of_blocks(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    good = {"timestamp": 0, "input_length": 512, "output_length": 4, "hash_ids": [0]}
    bad = {"timestamp": 5, "input_length": 513, "output_length": 4, "hash_ids": [0]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: input_length 513 needs 2 hash ids"):
        read_trace(path)
    with pytest.raises(ValueError, match="input_length 1025 needs 3 hash ids .* got 2"):
        write_trace(path, [TraceRequest(0, 1024 + 1, 4, [0, 1])])


def test_a_session_extends_its_previous_turns_full_blocks() -> None:
    cfg = TraceConfig(num_sessions=1, max_turns=6, system_blocks=2, max_input_len=4096, seed=1)
    turns = synthesize(cfg)
    assert len(turns) >= 3
    assert turns[0].hash_ids[:2] in ([0, 1], [0, 2])  # one of the two system prompts
    for prev, cur in zip(turns, turns[1:]):
        kept = prev.input_length // BLOCK_SIZE
        assert cur.hash_ids[:kept] == prev.hash_ids[:kept]
        assert cur.input_length >= prev.input_length + prev.output_length + cfg.min_user_len
        assert cur.timestamp >= prev.timestamp
        if prev.input_length % BLOCK_SIZE:  # the partial tail block is not shared
            assert prev.hash_ids[-1] not in cur.hash_ids
        new = cur.hash_ids[kept:]
        assert min(new) > max(h for t in turns[: turns.index(cur)] for h in t.hash_ids)


def test_sessions_share_system_prompts_and_the_seed_fixes_the_trace() -> None:
    cfg = TraceConfig(num_sessions=12, num_system_prompts=3, system_blocks=2, seed=7)
    trace = synthesize(cfg)
    assert trace == synthesize(cfg)
    assert trace != synthesize(TraceConfig(num_sessions=12, num_system_prompts=3, seed=8))
    assert {tuple(r.hash_ids[:2]) for r in trace} == {(0, 1), (0, 2), (0, 3)}
    for r in trace:
        assert cfg.min_output_len <= r.output_length <= cfg.max_output_len
        assert r.input_length <= cfg.max_input_len
    # ids past the system prompts belong to one session each: first turns never share them
    firsts = [r for r in trace if len(r.hash_ids) == 3]
    assert len({r.hash_ids[2] for r in firsts}) == len(firsts)


def test_config_rejects_a_first_turn_over_the_input_limit() -> None:
    with pytest.raises(ValueError, match="first turn may need 1408 tokens, over max_input_len"):
        TraceConfig(system_blocks=2, max_user_len=384, max_input_len=1024)
