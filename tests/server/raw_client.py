"""A raw HTTP/1.1 client over loopback sockets, for clients no library lets you be: one that
never reads its answer, one that trickles its body, one that closes its socket mid-request;
and what the server's metrics say about them."""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

NORMAL = {"prompt": "Hello there", "max_tokens": 16, "ignore_eos": True, "temperature": 0.0}
LONG_STREAM = {**NORMAL, "max_tokens": 2000, "stream": True}
# each connection's socket send buffer (``serve(sndbuf=...)``): about what a network path
# starts with (loopback starts at 4 MiB, so a client that stops reading is felt only after
# megabytes)
SNDBUF = 4096


def request_head(path: str, length: int) -> bytes:
    """A POST's head, for a JSON body of ``length`` bytes."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect: the window is agreed in the handshake
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    return sock


def stalled_streams(url: str, n: int) -> list[socket.socket]:
    """``n`` streaming requests for 2,000 tokens whose clients never read (a 4 KiB receive
    buffer: the server's writes block once its own buffers fill)."""
    body = json.dumps(LONG_STREAM).encode()
    socks = []
    for _ in range(n):
        sock = connect(url, rcvbuf=4096)
        sock.sendall(request_head("/v1/completions", len(body)) + body)
        socks.append(sock)
    return socks


def read_to_end(sock: socket.socket, timeout_s: float = 10.0) -> bytes:
    """What the server sent until it closed the connection (a reset counts as closed)."""
    sock.settimeout(timeout_s)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def assert_cut_mid_stream(data: bytes) -> None:
    """A stream's head and some events, never its end."""
    assert data.startswith(b"HTTP/1.1 200") and b"data: {" in data, data[:200]
    assert b"[DONE]" not in data


def trickle(socks: list[socket.socket], stop: threading.Event, byte: bytes) -> None:
    """``byte`` on each socket in turn, 0.2 s apart, until ``stop``: a body or a head that
    never ends in time."""
    while not stop.wait(0.2):
        for sock in socks:
            try:
                sock.send(byte)
            except OSError:  # answered and closed
                pass


def close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.close()


def metric(app: Any, name: str) -> float:
    """A sample of the app's metrics (0 when absent): ``name`` with its labels."""
    for line in app.state.server.metrics.render().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def client_gone(app: Any, where: str) -> float:
    return metric(app, f'pd_server_client_gone_total{{where="{where}"}}')
