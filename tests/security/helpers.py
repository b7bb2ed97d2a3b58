"""Running the stranger process, and capturing real sealed frames to hand it for replay."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from transfer.auth import Sealer

ROOT = Path(__file__).resolve().parents[2]


def run_stranger(actions: list[dict[str, Any]], timeout_s: float = 60.0) -> None:
    """Run ``tests.security.stranger`` (a process without the secret) over ``actions``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.security.stranger"],
        input=json.dumps(actions),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def unsigned(msg: Any) -> str:
    """A well-formed message as a frame, without the seal: hex for the stranger."""
    return msgspec.msgpack.encode(msg).hex()


def random_frames(n: int, seed: int) -> list[str]:
    gen = random.Random(seed)
    return [gen.randbytes(gen.randint(1, 300)).hex() for _ in range(n)]


class Captured:
    """Every frame sealed in this process while ``capture()`` is on, by audience."""

    def __init__(self) -> None:
        self.frames: dict[str, list[bytes]] = {}

    def first(self, audience: str) -> str:
        assert self.frames.get(audience), f"nothing sealed for {audience}: {list(self.frames)}"
        return self.frames[audience][0].hex()


def capture(monkeypatch: pytest.MonkeyPatch) -> Captured:
    """From now to the end of the test, what a sniffer on the wire would have: every frame
    sealed in this process, as sent."""
    captured = Captured()
    real_seal = Sealer.seal

    def seal(self: Sealer, payload: bytes) -> bytes:
        frame = real_seal(self, payload)
        captured.frames.setdefault(self.audience, []).append(frame)
        return frame

    monkeypatch.setattr(Sealer, "seal", seal)
    return captured
