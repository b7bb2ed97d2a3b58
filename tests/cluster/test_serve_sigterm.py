"""``pd serve`` as a process manager stops it (the colocated engine on a tiny model: a real
process, quick to start): SIGTERM under load finishes what is in flight, refuses new requests
with 503 and exits within the grace period."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cluster.conftest import serve_colocated

pytestmark = pytest.mark.timeout(120)

GRACE_S = 20.0
NUM_INFLIGHT = 6
GREEDY = {"ignore_eos": True, "temperature": 0.0}
STREAM = {"prompt": "Once upon a time", "max_tokens": 200, "stream": True, **GREEDY}
SHORT = {"prompt": "Hi", "max_tokens": 8, **GREEDY}


def _stream(url: str, started: threading.Event, out: dict[str, Any]) -> None:
    """One streaming request read to its end: its status, events and last finish reason."""
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=STREAM) as r:
                out["status"] = r.status_code
                events = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()
                out["events"] = events
    except Exception as e:  # the test looks at it
        out["error"] = repr(e)
    finally:
        started.set()


def test_sigterm_under_load_finishes_in_flight_refuses_new_and_exits_in_grace(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "serve.log"
    server = serve_colocated(tiny_llama_dir, log, "--shutdown-grace-s", str(GRACE_S))
    try:
        results: list[dict[str, Any]] = [{} for _ in range(NUM_INFLIGHT)]
        threads = []
        for out in results:
            started = threading.Event()
            thread = threading.Thread(target=_stream, args=(server.url, started, out))
            thread.start()
            threads.append(thread)
            assert started.wait(60), "a stream did not start"
        os.kill(server.proc.pid, signal.SIGTERM)  # the process, as a process manager does
        sigterm = time.monotonic()

        refused = None
        with httpx.Client(base_url=server.url, timeout=30) as http:
            while refused is None:  # until the signal is handled: those admitted run to the end
                assert time.monotonic() - sigterm < 5, "no 503 within 5 s of SIGTERM"
                r = http.post("/v1/completions", json=SHORT)
                if r.status_code == 503:
                    refused = r
                else:
                    assert r.status_code == 200, r.text
                    assert r.json()["usage"]["completion_tokens"] == SHORT["max_tokens"]
        for thread in threads:
            thread.join(60)
        server.proc.wait(timeout=GRACE_S + 10)
        exited_after = time.monotonic() - sigterm
    finally:
        server.end()
    print(f"SIGTERM with {NUM_INFLIGHT} streams in flight: exited after {exited_after:.1f} s")
    assert refused.headers["Retry-After"] and refused.headers["Connection"] == "close"
    assert refused.json()["error"]["code"] == "server_shutting_down"
    for out in results:  # every request in flight got its whole answer
        assert out.get("status") == 200 and "error" not in out, out
        assert out["events"][-1] == "[DONE]"
        chunks = [json.loads(e) for e in out["events"][:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for c in chunks if c["choices"][0]["text"]) >= STREAM["max_tokens"] // 2
    assert server.proc.returncode == 0, server.tail()
    assert exited_after < GRACE_S
    assert "Traceback" not in server.log.read_text(), server.tail()
