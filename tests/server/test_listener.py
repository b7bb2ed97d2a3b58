"""``pd serve``'s HTTP listener over real loopback sockets (the scripted fake engine): a request
head not in by its deadline is 408 and closed, from the opening or from the first byte after
an answer, while an idle kept-alive connection and a long answer are left alone; one
connection past the limit is 503 at once. The open-file limit is raised to the hard limit.
(test_silent_connections.py runs 2,000 silent sockets against a ``pd serve`` process.)"""

from __future__ import annotations

import json
import resource
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from pd.server import ServerMetrics
from pd.server.http.listener import Listener, max_connections_for, raise_fd_limit
from tests.server.conftest import serve, wait_for
from tests.server.fake_engine import FakeEngineClient
from tests.server.raw_client import NORMAL, close_all, connect, read_to_end, request_head

pytestmark = pytest.mark.timeout(60)

MakeApp = Callable[..., tuple[Any, FakeEngineClient]]
HEADER_TIMEOUT_S = 0.5
_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"


def _listener(app: Any, max_connections: int = 16) -> Listener:
    metrics: ServerMetrics = app.state.server.metrics
    return Listener(max_connections, HEADER_TIMEOUT_S, metrics)


def _answer_and_when(sock: socket.socket, since: float) -> tuple[bytes, float]:
    data = read_to_end(sock, timeout_s=5)
    return data, time.monotonic() - since


def _read_answer(sock: socket.socket) -> bytes:
    """One answer with a Content-Length, the connection left open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(65536)
    return data


def _assert_408(data: bytes) -> None:
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head, data
    assert json.loads(body)["error"]["code"] == "header_timeout", body


def test_a_head_not_in_by_its_deadline_is_408_and_an_answer_is_never_cut(
    make_app: MakeApp, script_ids: list[int]
) -> None:
    """Silent, half a head trickled, and half a head after a first answer on a kept-alive
    connection: each 408 and closed at the deadline. A stream that runs past it, and a
    kept-alive connection idle past it, are not touched."""
    app, _ = make_app(output_ids=script_ids * 4, delay_s=0.03)  # ~1.2 s streams
    listener = _listener(app)
    body = json.dumps({**NORMAL, "max_tokens": 2}).encode()
    with serve(app, listener=listener) as url:
        start = time.monotonic()
        silent = connect(url)
        partial = connect(url)
        partial.sendall(_HEAD)
        for _ in range(3):
            time.sleep(0.1)
            partial.sendall(b"X")  # bytes keep coming, the head never ends
        kept = connect(url)
        kept.sendall(request_head("/v1/completions", len(body)) + body)
        assert _read_answer(kept).startswith(b"HTTP/1.1 200 ")
        after_answer = time.monotonic()
        kept.sendall(_HEAD)  # the next head, never finished
        for sock, since in ((silent, start), (partial, start), (kept, after_answer)):
            data, took = _answer_and_when(sock, since)
            _assert_408(data)
            assert HEADER_TIMEOUT_S - 0.05 <= took <= HEADER_TIMEOUT_S + 1.0, took
        close_all([silent, partial, kept])

        with httpx.Client(base_url=url, timeout=10) as http:
            assert http.post("/v1/completions", json=NORMAL).status_code == 200
            time.sleep(2 * HEADER_TIMEOUT_S)  # idle, kept alive (uvicorn closes it after 5 s)
            assert http.post("/v1/completions", json=NORMAL).status_code == 200
            stream = {**NORMAL, "max_tokens": 40, "stream": True}
            start = time.monotonic()
            r = http.post("/v1/completions", json=stream)
            took = time.monotonic() - start
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text[-200:]
        assert took > 2 * HEADER_TIMEOUT_S, took
        wait_for(lambda: listener.num_open == 0)
    text = app.state.server.metrics.render().decode()
    assert 'pd_server_rejected_requests_total{reason="header_timeout"} 3.0' in text


def test_one_connection_past_the_limit_is_503_at_once(make_app: MakeApp) -> None:
    app, fake = make_app()
    listener = _listener(app, max_connections=3)
    with serve(app, listener=listener) as url:
        held = [connect(url) for _ in range(3)]
        wait_for(lambda: listener.num_open == 3)
        extra = connect(url)
        data, took = _answer_and_when(extra, time.monotonic())
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in head, data
        assert json.loads(body)["error"]["code"] == "too_many_connections", body
        assert took < HEADER_TIMEOUT_S, took
        held.pop().close()
        wait_for(lambda: listener.num_open == 2)
        with httpx.Client(base_url=url, timeout=10) as http:
            assert http.post("/v1/completions", json=NORMAL).status_code == 200
        close_all([extra, *held])
        wait_for(lambda: listener.num_open == 0)
    text = app.state.server.metrics.render().decode()
    assert 'pd_server_rejected_requests_total{reason="too_many_connections"} 1.0' in text
    assert len(fake.requests) == 1


def test_the_open_file_limit_is_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(soft, 256)
    if hard != resource.RLIM_INFINITY and hard <= lowered:
        pytest.skip(f"the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        raised = raise_fd_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == raised > lowered
        assert raise_fd_limit() == raised  # already there: unchanged
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert max_connections_for(0, 1024) == 512  # half the descriptors
    assert max_connections_for(0, 1 << 20) == 10_000
    assert max_connections_for(64, 1024) == 64  # as configured


def test_over_tls_a_handshake_counts_and_runs_on_the_head_deadline(
    make_app: MakeApp, tmp_path: Any
) -> None:
    """TLS inside the guard: a TCP connection that sends no ClientHello holds a place from
    its accept and is closed at the head's deadline; one more TLS client is closed at once;
    a TLS client is served, and half a head after its answer is 408 (over TLS) at the
    deadline; every place is given back."""
    pytest.importorskip("cryptography", reason="the dev extra's cryptography makes the cert")
    import ssl

    from tests.cluster.test_serve_tls import _self_signed

    cert, key = _self_signed(tmp_path)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    trust = ssl.create_default_context(cafile=str(cert))
    app, _ = make_app()
    metrics: ServerMetrics = app.state.server.metrics
    listener = Listener(2, HEADER_TIMEOUT_S, metrics, server_ctx)
    body = json.dumps({**NORMAL, "max_tokens": 2}).encode()
    with serve(app, listener=listener) as url:
        start = time.monotonic()
        silent = connect(url)  # no ClientHello
        client = trust.wrap_socket(connect(url), server_hostname="localhost")
        wait_for(lambda: listener.num_open == 2)
        with pytest.raises((ssl.SSLError, OSError)):  # one more: closed before its handshake
            trust.wrap_socket(connect(url), server_hostname="localhost").sendall(b"GET")
        client.sendall(request_head("/v1/completions", len(body)) + body)
        assert _read_answer(client).startswith(b"HTTP/1.1 200 ")
        client.sendall(_HEAD)  # half of the next head
        assert read_to_end(silent) == b""  # closed, no answer: there is no channel for one
        assert time.monotonic() - start >= HEADER_TIMEOUT_S - 0.05
        _assert_408(read_to_end(client))
        wait_for(lambda: listener.num_open == 0)
        close_all([silent, client])
    text = metrics.render().decode()
    assert 'pd_server_rejected_requests_total{reason="header_timeout"} 2.0' in text
    assert 'pd_server_rejected_requests_total{reason="too_many_connections"} 1.0' in text
