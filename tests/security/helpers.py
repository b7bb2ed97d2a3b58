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

from pdtools.chaos_cluster import listening_ports  # noqa: F401 - the tests' import
from transfer.auth import Opener, Sealer, reply_audience

ROOT = Path(__file__).resolve().parents[2]


def run_stranger(
    actions: list[dict[str, Any]], timeout_s: float = 60.0, idle: bool = False
) -> list[dict[str, Any]]:
    """Run ``tests.security.stranger`` (a process without the secret) over ``actions``; its
    result of each. ``idle``: it runs only on CPU time nothing else wants (``SCHED_IDLE``): a
    flood from another machine does not take this machine's cores, and here the cluster under
    test needs them. The lowest nice value would not do: Ray runs its workers, the nodes, at
    nice 15, and a process at 19 still took 0.6 of the 2 cores from them."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.security.stranger"],
        input=json.dumps(actions),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout_s,
        preexec_fn=_idle_class if idle else None,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _idle_class() -> None:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


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

    def first_reply(self, router: str) -> str:
        """The first frame the ROUTER at ``router`` sealed for one of its dealers."""
        prefix = reply_audience(router, b"")
        sent = [f for aud, fs in self.frames.items() if aud.startswith(prefix) for f in fs]
        assert sent, f"no reply sealed by {router}: {list(self.frames)}"
        return sent[0].hex()


def capture_opened(monkeypatch: pytest.MonkeyPatch, max_per_audience: int = 16) -> Captured:
    """From now to the end of the test, the first frames each socket of this process accepted
    (sealed elsewhere: a node's, to the server), as they came off the wire."""
    captured = Captured()
    real_open = Opener.open

    def open_(self: Opener, frame: bytes | memoryview) -> bytes | None:
        payload = real_open(self, frame)
        kept = captured.frames.setdefault(self.audience, [])
        if payload is not None and len(kept) < max_per_audience:
            kept.append(bytes(frame))
        return payload

    monkeypatch.setattr(Opener, "open", open_)
    return captured


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
