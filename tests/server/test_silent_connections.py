"""Silent and slow request heads against a real ``pd serve --colocated`` process (the tiny
model): 2,000 sockets that connect and send nothing, and some that trickle half a head, beside
normal requests. Each is answered 408 and closed at the header deadline while the normal
requests keep getting 200s; the server's descriptors return to their count before and its
memory stays bounded. Then, with ``--max-connections`` connections open, one more is answered
503 at once, and requests succeed again once the deadline has closed the silent ones."""

from __future__ import annotations

import os
import resource
import selectors
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.cluster.conftest import serve_colocated
from tests.server.raw_client import close_all, trickle

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

HEADER_TIMEOUT_S = 3.0
MARGIN_S = 2.0  # after the deadline, for the server to close them all (2 shared cores)
NUM_SILENT = 2000
NUM_PARTIAL = 50
MAX_CONNECTIONS = NUM_SILENT + NUM_PARTIAL + 50
MAX_RSS_GROWTH_MIB = 100.0
NORMAL = {"prompt": "Hello there", "max_tokens": 8, "ignore_eos": True, "temperature": 0.0}
PARTIAL_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"


def _raise_own_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"needs {need} open files, the hard limit is {hard}")
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def _num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _connect(port: int, first: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if first:
        sock.sendall(first)
    sock.setblocking(False)
    return sock


def _connect_many(port: int, n: int, first: bytes = b"") -> dict[socket.socket, float]:
    """``n`` sockets, each with when it connected (monotonic time)."""
    return {_connect(port, first): time.monotonic() for _ in range(n)}


def _wait_closed(
    socks: list[socket.socket], until: float
) -> tuple[dict[socket.socket, float], dict[socket.socket, bytes]]:
    """When the server closed each socket (monotonic time) and what it sent first, watching
    until ``until`` at most; sockets still open then are missing from the first dict."""
    closed: dict[socket.socket, float] = {}
    received = {sock: b"" for sock in socks}
    with selectors.DefaultSelector() as sel:
        for sock in socks:
            sel.register(sock, selectors.EVENT_READ)
        while len(closed) < len(socks) and time.monotonic() < until:
            for key, _ in sel.select(timeout=0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    continue
                except ConnectionResetError:
                    data = b""
                received[sock] += data
                if not data:
                    closed[sock] = time.monotonic()
                    sel.unregister(sock)
    return closed, received


class _Traffic:
    """Normal requests in turn on a thread, until stopped: (status, latency) of each."""

    def __init__(self, url: str) -> None:
        self.results: list[tuple[int, float]] = []
        self._url = url
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def __enter__(self) -> _Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "a normal request did not end in 30 s"

    def _run(self) -> None:
        with httpx.Client(base_url=self._url, timeout=10) as http:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    status = http.post("/v1/completions", json=NORMAL).status_code
                except httpx.HTTPError:
                    status = 0
                self.results.append((status, time.perf_counter() - start))


def _latencies(url: str, n: int) -> list[float]:
    out = []
    with httpx.Client(base_url=url, timeout=10) as http:
        for _ in range(n):
            start = time.perf_counter()
            r = http.post("/v1/completions", json=NORMAL)
            out.append(time.perf_counter() - start)
            assert r.status_code == 200, r.text
    return out


def _fds_back_to(pid: int, baseline: int, timeout_s: float = 5.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (n := _num_fds(pid)) > baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def test_silent_and_slow_heads_are_closed_at_the_deadline_beside_normal_traffic(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    _raise_own_fd_limit(2 * MAX_CONNECTIONS + 256)
    server = serve_colocated(
        tiny_llama_dir, tmp_path / "serve.log",
        "--header-timeout-s", str(HEADER_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS),
    )  # fmt: skip
    pid, port = server.proc.pid, server.port
    socks: list[socket.socket] = []
    stop = threading.Event()
    trickler: threading.Thread | None = None
    try:
        _latencies(server.url, 2)  # warm-up
        unloaded = _latencies(server.url, 8)
        time.sleep(0.5)  # the server closes the client's connection
        baseline_fds, baseline_rss = _num_fds(pid), _rss_mib(pid)

        with _Traffic(server.url) as traffic:
            start = time.monotonic()
            connected = _connect_many(port, NUM_SILENT)
            partial = _connect_many(port, NUM_PARTIAL, PARTIAL_HEAD)
            connected.update(partial)
            socks = list(connected)
            opened_by = time.monotonic() - start
            trickler = threading.Thread(target=trickle, args=(list(partial), stop, b"X"))
            trickler.start()
            peak_fds = _num_fds(pid)
            time.sleep(HEADER_TIMEOUT_S / 2)
            peak_fds, peak_rss = max(peak_fds, _num_fds(pid)), _rss_mib(pid)
            closed, received = _wait_closed(socks, start + HEADER_TIMEOUT_S + MARGIN_S + opened_by)
        stop.set()
        trickler.join(10)
        fds_after = _fds_back_to(pid, baseline_fds)
        after = [closed[s] - connected[s] for s in socks if s in closed]
        statuses = [status for status, _ in traffic.results]
        beside = [latency for _, latency in traffic.results]
        print(
            f"{len(socks)} silent/partial sockets opened in {opened_by:.2f} s; "
            f"{len(closed)} closed by the server, "
            f"{min(after, default=0):.2f}..{max(after, default=0):.2f} s after connecting "
            f"(deadline {HEADER_TIMEOUT_S:g} s); server fds {baseline_fds} -> {peak_fds} -> "
            f"{fds_after}; RSS {baseline_rss:.0f} -> {peak_rss:.0f} MiB; {len(statuses)} normal "
            f"requests beside, statuses {sorted(set(statuses))}, p50 "
            f"{statistics.median(beside) * 1e3:.0f} ms, max {max(beside) * 1e3:.0f} ms "
            f"(unloaded p50 {statistics.median(unloaded) * 1e3:.0f} ms)"
        )
        assert len(closed) == len(socks), f"{len(socks) - len(closed)} still open"
        assert min(after) >= HEADER_TIMEOUT_S - 0.1, "closed before the deadline"
        assert max(after) <= HEADER_TIMEOUT_S + MARGIN_S, after
        for sock in socks:
            assert received[sock].startswith(b"HTTP/1.1 408 "), received[sock][:200]
            assert b'"code":"header_timeout"' in received[sock], received[sock]
        assert peak_fds >= baseline_fds + len(socks)  # the server did hold them all
        assert fds_after <= baseline_fds, (baseline_fds, fds_after)
        assert peak_rss - baseline_rss <= MAX_RSS_GROWTH_MIB, (baseline_rss, peak_rss)
        assert statuses and set(statuses) == {200}, statuses
        base = statistics.median(unloaded)
        assert statistics.median(beside) <= max(3 * base, base + 0.25), (unloaded, beside)
        assert max(beside) <= 5.0, beside
        close_all(socks)

        # --max-connections open: one more is answered 503 at once, then closed
        socks = list(_connect_many(port, MAX_CONNECTIONS))
        full_at = time.monotonic()
        deadline = full_at + 5
        while _num_fds(pid) < baseline_fds + MAX_CONNECTIONS and time.monotonic() < deadline:
            time.sleep(0.05)
        extra = _connect(port)
        socks.append(extra)
        _, refused = _wait_closed([extra], time.monotonic() + 1.0)
        assert refused[extra].startswith(b"HTTP/1.1 503 "), refused[extra][:200]
        assert b'"code":"too_many_connections"' in refused[extra], refused[extra]
        held = socks[:-1]
        closed, _ = _wait_closed(held, full_at + HEADER_TIMEOUT_S + MARGIN_S)
        assert len(closed) == len(held), f"{len(held) - len(closed)} still open"
        assert len(_latencies(server.url, 2)) == 2  # 200s again
        print(f"at {MAX_CONNECTIONS} connections one more got 503 at once; 200s after")
    finally:
        stop.set()
        if trickler is not None:
            trickler.join(10)
        close_all(socks)
        server.end()
