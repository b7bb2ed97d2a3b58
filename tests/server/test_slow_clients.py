"""Slow and quiet clients under uvicorn, over real TCP sockets: streams whose clients never
read, bodies that trickle in, a queued client that disconnects. Each holds nothing past its
bound, and normal requests beside them keep their latency.

The latency checks run on the scripted fake engine: its tokens cost no compute, so what they
measure is what the slow clients hold, not the work of the model on a shared 2-core machine
(test_stalled_engine.py shows a stream cut off on the colocated engine gives its slots back).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from pd.server import ServerConfig
from tests.server.conftest import errors_logged, serve, wait_for
from tests.server.fake_engine import FakeEngineClient
from tests.server.raw_client import (
    NORMAL,
    SNDBUF,
    assert_cut_mid_stream,
    client_gone,
    close_all,
    connect,
    read_to_end,
    request_head,
    stalled_streams,
    trickle,
)

pytestmark = pytest.mark.timeout(60)

MakeApp = Callable[..., tuple[Any, FakeEngineClient]]

NUM_STALLED = 20
WRITE_TIMEOUT_S = 3.0
BODY_TIMEOUT_S = 4.0
FAKE_DELAY_S = 0.005  # per token of the fake engine: a normal request takes ~80 ms


def _latencies(url: str, n: int, until: Callable[[], bool] | None = None) -> list[float]:
    """Latencies of ``n`` normal requests in turn (more, while ``until()`` is false; 30 s at
    most)."""
    out: list[float] = []
    deadline = time.monotonic() + 30
    with httpx.Client(base_url=url, timeout=30) as http:
        while len(out) < n or (until is not None and not until()):
            assert time.monotonic() < deadline, f"not done after {len(out)} requests in 30 s"
            start = time.perf_counter()
            r = http.post("/v1/completions", json=NORMAL)
            out.append(time.perf_counter() - start)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 16
    return out


def _report(unloaded: list[float], beside: list[float], what: str, more: str) -> float:
    """Print the normal requests' medians alone and beside ``what``; return their ratio."""
    base, loaded = statistics.median(unloaded), statistics.median(beside)
    print(
        f"unloaded p50 {base * 1e3:.0f} ms; beside {what} p50 {loaded * 1e3:.0f} ms "
        f"({loaded / base:.2f}x); {more}"
    )
    return loaded / base


@pytest.mark.slow
def test_streams_whose_clients_never_read_are_cut_and_slow_nobody(
    make_app: MakeApp, script_ids: list[int]
) -> None:
    """20 streams of 2,000 tokens whose clients read nothing: their sends block once the
    socket buffers fill, and after the write timeout each connection is cut and its request
    aborted. Normal requests sent all the while keep their latency (median within 2x of the
    unloaded one); afterwards nothing runs and no admission place is held."""
    app, fake = make_app(
        config=ServerConfig(stream_write_timeout_s=WRITE_TIMEOUT_S),
        output_ids=script_ids * 120,
        delay_s=FAKE_DELAY_S,
        max_model_len=4096,
    )
    state = app.state.server
    with serve(app, sndbuf=SNDBUF) as url, errors_logged() as errors:
        _latencies(url, 2)  # warm-up
        unloaded = _latencies(url, 8)
        start = time.monotonic()
        stalled = stalled_streams(url, NUM_STALLED)
        beside = _latencies(url, 8, until=lambda: client_gone(app, "stalled") == NUM_STALLED)
        cut_after = time.monotonic() - start
        received = [read_to_end(sock) for sock in stalled]
        wait_for(lambda: state.admission.num_inflight == 0 and len(fake.aborted) == NUM_STALLED)
        text = state.metrics.render().decode()
    close_all(stalled)
    ratio = _report(
        unloaded, beside, f"{NUM_STALLED} stalled streams ({len(beside)} requests)",
        f"all cut by {cut_after:.1f} s (write timeout {WRITE_TIMEOUT_S:g} s); each client got "
        f"{min(map(len, received))}..{max(map(len, received))} bytes",
    )  # fmt: skip
    assert ratio <= 2.0, (unloaded, beside)
    assert cut_after >= WRITE_TIMEOUT_S
    for data in received:
        assert_cut_mid_stream(data)
    stalled_ids = {rid for rid, _, p in fake.requests if p.max_tokens == 2000}
    # each aborted at the cut, unless its generation had ended before (its place came back then)
    aborted, done = set(fake.aborted), set(fake.finished) & stalled_ids
    assert aborted == set(fake.cancelled) and aborted | done == stalled_ids and aborted
    assert f'pd_requests_total{{finish_reason="abort"}} {len(aborted)}.0' in text
    assert "pd_server_running_requests 0.0" in text
    assert "pd_server_admitted_requests 0.0" in text
    assert not errors, [r.getMessage() for r in errors]  # a cut is not a server error


def _dechunk(data: bytes) -> bytes:
    """The body of an HTTP/1.1 response with chunked transfer encoding."""
    _, _, rest = data.partition(b"\r\n\r\n")
    body = []
    while True:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return b"".join(body)
        body.append(rest[:n])
        rest = rest[n + 2 :]


class _SteadyReader:
    """A streaming request whose client reads ``step`` bytes every ``interval_s`` through a
    4 KiB receive buffer (always within the write timeout, so never cut), until ``hurry``:
    then as fast as it can, to the end."""

    def __init__(self, url: str, body: dict[str, Any], step: int, interval_s: float) -> None:
        payload = json.dumps(body).encode()
        self.sock = connect(url, rcvbuf=4096)
        self.sock.sendall(request_head("/v1/completions", len(payload)) + payload)
        self.hurry = threading.Event()
        self.data = b""
        self.num_read = 0
        self.is_done = False
        self._step, self._interval_s = step, interval_s
        self._thread = threading.Thread(target=self._read)
        self._thread.start()

    def _read(self) -> None:
        chunks = []
        while chunk := self.sock.recv(self._step if not self.hurry.is_set() else 65536):
            chunks.append(chunk)
            self.num_read += len(chunk)
            if b"".join(chunks[-2:]).endswith(b"\r\n0\r\n\r\n"):  # the last chunk, whole
                break
            self.hurry.wait(self._interval_s)
        self.data = b"".join(chunks)
        self.is_done = True

    def join(self) -> bytes:
        self.hurry.set()
        self._thread.join(20)
        assert not self._thread.is_alive()
        self.sock.close()
        return self.data


@pytest.mark.parametrize("sndbuf", [SNDBUF, 64 << 10])
def test_a_slow_but_steady_reader_is_not_cut_by_the_write_timeout(
    make_app: MakeApp, script_ids: list[int], sndbuf: int
) -> None:
    """A stream of 1,500 tokens (~240 KiB) whose client reads 2 KiB every 50 ms (40 KiB/s)
    under a write timeout of 0.5 s. Once uvicorn's buffer is full a send waits for it to
    drain from 64 to 16 KiB (1.2 s at that pace); and the kernel takes more of it only once a
    third of its send buffer is free (64 KiB asked: 128 KiB, a third of it ~1 s), while the
    client takes bytes all along. It gets its whole answer and nothing counts as stalled.
    Before, a send pending 0.5 s reset it (the chaos soak's slow readers, 5 KiB/s under 8 s,
    were cut so); and a watchdog that looked at uvicorn's buffer alone saw no progress behind
    a kernel buffer of 128 KiB."""
    app, _ = make_app(
        config=ServerConfig(stream_write_timeout_s=0.5),
        output_ids=script_ids * 150,
        max_model_len=4096,
    )
    body = {**NORMAL, "max_tokens": 1500, "stream": True}
    with serve(app, sndbuf=sndbuf) as url, errors_logged() as errors:
        start = time.monotonic()
        reader = _SteadyReader(url, body, 2048, 0.05)
        wait_for(lambda: reader.is_done, timeout_s=30)
        took = time.monotonic() - start
        data = reader.join()
    events = _dechunk(data).split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""], (took, len(data), events[-3:])
    assert len(data) > 192 << 10 and took > 3.0  # long past the timeout, many sends
    assert client_gone(app, "stalled") == 0
    assert not errors, [r.getMessage() for r in errors]


def test_slow_but_steady_readers_give_their_places_back_when_generation_ends(
    make_app: MakeApp, script_ids: list[int]
) -> None:
    """As many streams as there are admission places (4), 1,000 tokens each, whose clients
    read 512 bytes every 100 ms: never idle long enough for the write timeout, yet seconds behind
    the engine. Each place comes back when its request's generation ends, while its client
    still reads (the rest of its answer is held in its pipe, under the server's budget for
    that), so normal requests sent then are admitted at once and keep their latency; the
    slow clients still get their whole answers, and the bytes held go back to 0. Before, each
    held its place until its client had read all but what uvicorn's and the kernel's buffers
    take, generating at its client's pace."""
    limit, num_tokens = 4, 1000
    app, fake = make_app(
        config=ServerConfig(max_inflight_requests=limit),
        output_ids=script_ids * 60,
        delay_s=0.001,
        max_model_len=4096,
    )
    state = app.state.server
    slow_body = {**NORMAL, "max_tokens": num_tokens, "stream": True}
    with serve(app, sndbuf=SNDBUF) as url, errors_logged() as errors:
        _latencies(url, 2)  # warm-up
        unloaded = _latencies(url, 8)
        start = time.monotonic()
        readers = [_SteadyReader(url, slow_body, 512, 0.1) for _ in range(limit)]
        try:
            wait_for(lambda: len(fake.finished) == 10 + limit, timeout_s=20)
            generated_by = time.monotonic() - start
            wait_for(lambda: state.admission.num_inflight == 0, timeout_s=2)
            read_then = [r.num_read for r in readers]  # before their places came back
            # of ~160 KiB each: their places came back while they had read under a third
            # (before, only once uvicorn's 64 KiB buffer and the kernel's took the rest)
            assert max(read_then) < 48 << 10, read_then
            held = state.stream_bytes
            num_held, num_bytes = held.num_streams, held.num_bytes
            beside = _latencies(url, 8)
            still_reading = sum(not r.is_done for r in readers)
        finally:
            answers = [r.join() for r in readers]
        read_by = time.monotonic() - start
        wait_for(lambda: held.num_streams == 0 and held.num_bytes == 0)
        with httpx.Client(base_url=url, timeout=30) as http:
            plain = http.post("/v1/completions", json={**slow_body, "stream": False})
            whole = plain.json()["choices"][0]["text"]
    ratio = _report(
        unloaded, beside, f"{limit} slow readers (admission limit {limit})",
        f"their generation over by {generated_by:.1f} s, their clients having read "
        f"{max(read_then) / 1024:.0f} of {len(answers[0]) / 1024:.0f} KiB; {num_held} streams "
        f"holding {num_bytes / 1024:.0f} KiB for their clients then; hurried readers done by "
        f"{read_by:.1f} s",
    )  # fmt: skip
    assert still_reading == limit  # the normal requests ran while they read
    assert all(len(a) > 3 * (48 << 10) for a in answers)
    assert num_held == limit and 0 < num_bytes <= held.max_bytes
    assert ratio <= 2.0, (unloaded, beside)
    for data in answers:  # whole: the text a client reading at once gets, then [DONE]
        events = _dechunk(data).split(b"\n\n")
        assert events[-2:] == [b"data: [DONE]", b""], events[-3:]
        chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert state.admission.num_inflight == 0 and not fake.aborted
    assert not errors, [r.getMessage() for r in errors]


@pytest.mark.slow
def test_slow_bodies_hold_no_place_and_get_408(make_app: MakeApp, script_ids: list[int]) -> None:
    """Three times the admission limit of clients trickle their bodies: normal requests beside
    them are admitted at once and keep their latency; each slow one gets 408 at the body-read
    deadline and its connection closed; nothing is held afterwards."""
    limit = 4
    config = ServerConfig(max_inflight_requests=limit, body_read_timeout_s=BODY_TIMEOUT_S)
    app, fake = make_app(config=config, output_ids=script_ids * 2, delay_s=FAKE_DELAY_S)
    admission = app.state.server.admission
    with serve(app) as url:
        _latencies(url, 2)
        unloaded = _latencies(url, 8)
        start = time.monotonic()
        slow = [connect(url) for _ in range(3 * limit)]
        for sock in slow:
            sock.sendall(request_head("/v1/completions", 200) + b'{"prompt": "')
        stop = threading.Event()
        trickler = threading.Thread(target=trickle, args=(slow, stop, b" "))
        trickler.start()
        try:
            beside = _latencies(url, 8)
            beside_by = time.monotonic() - start
            answers = [read_to_end(sock) for sock in slow]
            answered_by = time.monotonic() - start
        finally:
            stop.set()
            trickler.join()
        wait_for(lambda: admission.num_inflight == 0)
        text = app.state.server.metrics.render().decode()
    close_all(slow)
    ratio = _report(
        unloaded, beside, f"{len(slow)} slow bodies (admission limit {limit})",
        f"done by {beside_by:.1f} s; all answered 408 and closed by {answered_by:.1f} s "
        f"(deadline {BODY_TIMEOUT_S:g} s)",
    )  # fmt: skip
    assert beside_by < BODY_TIMEOUT_S, "normal traffic ran after the slow bodies were refused"
    assert ratio <= 2.0, (unloaded, beside)
    for data in answers:
        head, _, payload = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower(), data
        error = json.loads(payload)["error"]
        assert error["code"] == "body_timeout" and error["type"] == "timeout_error", error
    assert f'pd_server_rejected_requests_total{{reason="body_timeout"}} {len(slow)}.0' in text
    assert len(fake.requests) == 2 + 8 + 8  # the slow ones never reached the engine
    assert admission.num_queued == 0


def test_a_queued_client_that_disconnects_leaves_the_queue_at_once(
    make_app: MakeApp, script_ids: list[int]
) -> None:
    """With the only place taken, a client whose request waits in the queue closes its
    socket: it leaves the queue at once (not when the place frees), counted, never reaches
    the engine, and nothing is logged as an error."""
    app, fake = make_app(
        config=ServerConfig(max_inflight_requests=1), output_ids=script_ids * 40, delay_s=0.01
    )
    admission = app.state.server.admission
    first_body = {"prompt": "Hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
    body = json.dumps({"prompt": "Hi", "max_tokens": 4}).encode()
    with (
        serve(app) as url,
        errors_logged() as errors,
        httpx.Client(base_url=url, timeout=30) as http,
    ):
        with http.stream("POST", "/v1/completions", json=first_body) as first:
            assert first.status_code == 200
            queued = connect(url)
            queued.sendall(request_head("/v1/completions", len(body)) + body)
            wait_for(lambda: admission.num_queued == 1)
            queued.close()
            closed = time.monotonic()
            wait_for(lambda: admission.num_queued == 0, timeout_s=2)
            left_after = time.monotonic() - closed
            assert admission.num_inflight == 1 and not fake.finished  # the first still runs
            assert "[DONE]" in "".join(first.iter_text())
        wait_for(lambda: admission.num_inflight == 0)
    print(f"left the queue {left_after * 1e3:.0f} ms after its client closed the socket")
    assert left_after < 0.5
    assert len(fake.requests) == 1  # the queued one never reached the engine
    assert client_gone(app, "queued") == 1
    assert not errors, [r.getMessage() for r in errors]


class Echo(BaseModel):
    x: int


def test_a_slow_body_is_408_on_a_route_fastapi_parses_too(make_app: MakeApp) -> None:
    """FastAPI answers 400 to any error while it reads a body itself, but the deadline's
    408 passes through (as the admin routes' bodies are read)."""
    app, _ = make_app(config=ServerConfig(body_read_timeout_s=0.5))

    @app.post("/echo")
    async def echo(body: Echo) -> dict[str, int]:
        return {"x": body.x}

    with serve(app) as url:
        with httpx.Client(base_url=url, timeout=10) as http:
            assert http.post("/echo", json={"x": 1}).json() == {"x": 1}
        sock = connect(url)
        sock.sendall(request_head("/echo", 20) + b'{"x": ')
        data = read_to_end(sock)
        sock.close()
    head, _, payload = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data
    assert json.loads(payload)["error"]["code"] == "body_timeout"


def test_a_client_that_leaves_mid_body_is_counted_not_an_error(make_app: MakeApp) -> None:
    app, fake = make_app()
    with serve(app) as url, errors_logged() as errors:
        sock = connect(url)
        sock.sendall(request_head("/v1/completions", 200) + b'{"prompt": "')
        time.sleep(0.2)  # the server is reading the body
        sock.close()
        wait_for(lambda: client_gone(app, "body") == 1)
    assert fake.requests == [] and app.state.server.admission.is_empty
    assert not errors, [r.getMessage() for r in errors]
