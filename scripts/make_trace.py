"""Synthesize a Mooncake-format request trace with shared prefixes (the format:
``pdtools/trace.py``).

The synthesizer writes a trace a 2-core CPU can serve: sessions arrive as a Poisson process; each
opens with one of a few system prompts (full blocks, all starting with block 0, as every request
of Mooncake's conversation trace does), then turns of user text; each next turn is the previous
prompt + its answer + new user text, so its ids extend the previous turn's full blocks.

    python scripts/make_trace.py --out trace.jsonl --num-sessions 8 --session-rate 0.5
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass

from pdtools.trace import BLOCK_SIZE, TraceRequest, write_trace


@dataclass(frozen=True)
class TraceConfig:
    num_sessions: int = 8
    session_rate: float = 0.5  # sessions per second, Poisson
    max_turns: int = 4
    turn_gap_s: float = 4.0  # mean think time between a session's turns, exponential
    num_system_prompts: int = 2
    system_blocks: int = 2  # full blocks per system prompt (block 0 is common to all)
    min_user_len: int = 32
    max_user_len: int = 384
    min_output_len: int = 16
    max_output_len: int = 64
    max_input_len: int = 2560  # a session ends before its prompt would pass this
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_sessions < 1 or self.max_turns < 1 or self.session_rate <= 0:
            raise ValueError(
                f"need sessions >= 1, turns >= 1, rate > 0: got {self.num_sessions}, "
                f"{self.max_turns}, {self.session_rate}"
            )
        if self.num_system_prompts < 1 or self.system_blocks < 1:
            raise ValueError(
                f"need >= 1 system prompt of >= 1 block, got {self.num_system_prompts} "
                f"of {self.system_blocks}"
            )
        if not 1 <= self.min_user_len <= self.max_user_len:
            raise ValueError(f"user lengths {self.min_user_len}..{self.max_user_len}")
        if not 1 <= self.min_output_len <= self.max_output_len:
            raise ValueError(f"output lengths {self.min_output_len}..{self.max_output_len}")
        first_turn = self.system_blocks * BLOCK_SIZE + self.max_user_len
        if first_turn > self.max_input_len:
            raise ValueError(
                f"a first turn may need {first_turn} tokens, over max_input_len "
                f"{self.max_input_len}"
            )


def synthesize(cfg: TraceConfig) -> list[TraceRequest]:
    """A seeded trace of ``cfg.num_sessions`` multi-turn sessions, sorted by timestamp."""
    rng = random.Random(cfg.seed)
    # system prompt p: block 0, then (system_blocks - 1) blocks of its own
    systems = [
        [0] + [1 + p * (cfg.system_blocks - 1) + i for i in range(cfg.system_blocks - 1)]
        for p in range(cfg.num_system_prompts)
    ]
    next_id = 1 + cfg.num_system_prompts * (cfg.system_blocks - 1)
    requests = []
    start_s = 0.0
    for _ in range(cfg.num_sessions):
        start_s += rng.expovariate(cfg.session_rate)
        t_s = start_s
        ids = list(rng.choice(systems))
        length = len(ids) * BLOCK_SIZE + rng.randint(cfg.min_user_len, cfg.max_user_len)
        for _ in range(cfg.max_turns):
            while len(ids) < math.ceil(length / BLOCK_SIZE):
                ids.append(next_id)
                next_id += 1
            output = rng.randint(cfg.min_output_len, cfg.max_output_len)
            requests.append(TraceRequest(round(t_s * 1000), length, output, list(ids)))
            del ids[length // BLOCK_SIZE :]  # the next turn keeps the full blocks only
            length += output + rng.randint(cfg.min_user_len, cfg.max_user_len)
            if length > cfg.max_input_len:
                break
            t_s += rng.expovariate(1 / cfg.turn_gap_s)
    requests.sort(key=lambda r: r.timestamp)
    return requests


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, help="JSONL file to write")
    for name, default in vars(TraceConfig()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    args = vars(p.parse_args(argv))
    out = args.pop("out")
    requests = synthesize(TraceConfig(**args))
    write_trace(out, requests)
    tokens = sum(r.input_length for r in requests)
    unique = len({h for r in requests for h in r.hash_ids})
    print(
        f"{out}: {len(requests)} requests over {requests[-1].timestamp / 1000:.1f} s, "
        f"{tokens} input tokens in {sum(len(r.hash_ids) for r in requests)} blocks "
        f"({unique} distinct)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
