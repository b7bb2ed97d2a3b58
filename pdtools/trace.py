"""Mooncake-format request traces: read and write them.

The format (Mooncake's published traces): one JSON object per line,
``{"timestamp": ms since start, "input_length": tokens, "output_length": tokens,
"hash_ids": [int, ...]}``, where each hash id names one 512-token block of the prompt and equal
ids are equal blocks; ``len(hash_ids) == ceil(input_length / 512)`` and the last block may be
partial. A conversation's next turn repeats every id of the previous turn's full blocks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

BLOCK_SIZE = 512  # tokens per hash id, fixed by the format


class TraceRequest(NamedTuple):
    timestamp: int  # ms since the trace's start
    input_length: int
    output_length: int
    hash_ids: list[int]


def check_request(r: TraceRequest) -> None:
    want = math.ceil(r.input_length / BLOCK_SIZE)
    if r.input_length < 1 or r.output_length < 1 or r.timestamp < 0:
        raise ValueError(f"bad trace request {r}: lengths must be >= 1, timestamp >= 0")
    if len(r.hash_ids) != want:
        raise ValueError(
            f"input_length {r.input_length} needs {want} hash ids of {BLOCK_SIZE} tokens, "
            f"got {len(r.hash_ids)}"
        )


def read_trace(path: str | Path) -> list[TraceRequest]:
    """The requests of a Mooncake-format JSONL file, in file order (checked)."""
    requests = []
    for num, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        d = json.loads(line)
        try:
            r = TraceRequest(
                int(d["timestamp"]), d["input_length"], d["output_length"], list(d["hash_ids"])
            )
            check_request(r)
        except (KeyError, ValueError) as e:
            raise ValueError(f"{path}:{num}: {e}") from e
        requests.append(r)
    return requests


def write_trace(path: str | Path, requests: list[TraceRequest]) -> None:
    with open(path, "w") as f:
        for r in requests:
            check_request(r)
            f.write(json.dumps(r._asdict()) + "\n")
