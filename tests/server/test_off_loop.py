"""Work a request brings that grows with what it asks for runs off the server's event loop:
while one non-streamed answer is built and serialized (n choices of many tokens with their
``top_logprobs`` take seconds), ``/health`` and other requests are answered at once."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from pd.server.routes import completions
from tests.server.conftest import serve


@pytest.mark.timeout(60)
def test_a_slow_final_answer_does_not_hold_the_event_loop(make_app: Any, monkeypatch) -> None:
    built = threading.Event()
    original = completions.CompletionRenderer.final

    def slow_final(self: Any) -> Any:  # as a large n x top_logprobs answer: seconds of work
        time.sleep(2.0)
        built.set()
        return original(self)

    monkeypatch.setattr(completions.CompletionRenderer, "final", slow_final)
    app, _ = make_app(output_ids=[100, 101])
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        answer: dict[str, Any] = {}

        def ask() -> None:
            r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            answer["status"] = r.status_code

        asker = threading.Thread(target=ask)
        asker.start()
        worst = 0.0
        with httpx.Client(base_url=url, timeout=30) as probe:
            while not built.is_set():
                t0 = time.perf_counter()
                assert probe.get("/health").status_code == 200
                worst = max(worst, time.perf_counter() - t0)
                time.sleep(0.05)
        asker.join(30)
        assert answer == {"status": 200}
        assert worst < 1.0, f"/health waited {worst:.2f} s while an answer was built"
