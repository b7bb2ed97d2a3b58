"""The server under test, from outside, for ``scripts/chaos_soak.py``:

- ``Api``: its routes (``/admin/*``, ``/metrics``, readiness), each with the key it needs;
- ``Monitor``: polls the pools and readiness once a second, and remembers when nodes left,
  when the server was not ready and when a pool had no ready node;
- ``ServeProcess``: a ``pd serve`` the soak starts in a session of its own, and ends with every
  process of that session, by pid;
- ``ProcessTree``: which pids the soak may signal (descendants of the server it tests).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import httpx

ROLES = ("prefill", "decode")
ADMIN_TIMEOUT_S = 10.0
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class Pools(NamedTuple):
    """``GET /admin/nodes``: the pools' targets and every node's view."""

    target: dict[str, int]
    nodes: list[dict[str, Any]]

    def of(self, role: str, state: str = "ready") -> list[dict[str, Any]]:
        return [n for n in self.nodes if n["role"] == role and n["state"] == state]

    @property
    def ids(self) -> set[str]:
        return {n["id"] for n in self.nodes}

    def is_whole(self, sizes: dict[str, int]) -> bool:
        """Each pool has ``sizes[role]`` ready nodes and none starts or drains."""
        return all(n["state"] == "ready" for n in self.nodes) and all(
            len(self.of(r)) == sizes[r] and self.target[r] == sizes[r] for r in ROLES
        )


class Metrics(dict[tuple[str, tuple[tuple[str, str], ...]], float]):
    """Prometheus text, parsed: (name, sorted labels) -> value."""

    @classmethod
    def parse(cls, text: str) -> Metrics:
        out = cls()
        for line in text.splitlines():
            if line.startswith("#") or not (m := _SAMPLE.match(line)):
                continue
            labels = tuple(sorted(_LABEL.findall(m[2] or "")))
            out[(m[1], labels)] = float(m[3])
        return out

    def value(self, name: str, **labels: str) -> float:
        return self.get((name, tuple(sorted(labels.items()))), 0.0)

    def total(self, name: str) -> float:
        return sum(v for (n, _), v in self.items() if n == name)

    def by(self, name: str, label: str) -> dict[str, float]:
        return {
            dict(ls)[label]: v for (n, ls), v in self.items() if n == name and dict(ls).get(label)
        }


class Api:
    """The server's operating routes. ``admin_key``: for ``/admin/*`` and ``/metrics`` (the
    API key when the server has no admin keys); ``api_key``: for everything else."""

    def __init__(self, url: str, api_key: str | None, admin_key: str | None) -> None:
        self.url = url
        self.api_key = api_key
        self.admin_key = admin_key or api_key
        self.http = httpx.AsyncClient(base_url=url, timeout=ADMIN_TIMEOUT_S)
        self._has_ready: bool | None = None  # does the server have GET /ready?

    def headers(self, admin: bool = False) -> dict[str, str]:
        key = self.admin_key if admin else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def pools(self) -> Pools:
        r = await self.http.get("/admin/nodes", headers=self.headers(admin=True))
        r.raise_for_status()
        body = r.json()
        for node in body["nodes"]:  # a server older than these: its nodes are not signalled
            node.setdefault("pid", 0)
            node.setdefault("addr", "")
            node.setdefault("transfer_addr", "")
        return Pools(body["target"], body["nodes"])

    async def metrics(self) -> Metrics:
        r = await self.http.get("/metrics", headers=self.headers(admin=True))
        r.raise_for_status()
        return Metrics.parse(r.text)

    async def readiness(self) -> tuple[bool, str]:
        """``GET /ready`` where the server has it (200 or 503), else ``GET /health``."""
        if self._has_ready is not False:
            r = await self.http.get("/ready")
            if r.status_code in (200, 503):
                self._has_ready = True
                return r.status_code == 200, r.text[:200]
            self._has_ready = False
        r = await self.http.get("/health")
        return r.status_code == 200, r.text[:200]

    async def routes(self, request_id: str) -> list[dict[str, Any]]:
        """Where each attempt of a request went (``GET /admin/routes``; [] where the server
        has no such endpoint)."""
        r = await self.http.get(
            "/admin/routes", params={"request_id": request_id}, headers=self.headers(admin=True)
        )
        return r.json()["attempts"] if r.status_code == 200 else []

    async def drain(self, node_id: str) -> httpx.Response:
        return await self.http.post(f"/admin/nodes/{node_id}/drain", headers=self.headers(True))

    async def scale(self, **sizes: int) -> httpx.Response:
        return await self.http.post("/admin/scale", json=sizes, headers=self.headers(True))

    async def close(self) -> None:
        await self.http.aclose()


class Interval(NamedTuple):
    start: float
    end: float
    what: str


class Monitor:
    """Polls the pools and readiness every ``period_s`` until ``stop()``. ``pools``: the last
        answer; ``left``: node id -> when it was last seen (it left the pools), ``first_seen``: when
    it was first; ``not_ready`` and
        ``empty_pools``: intervals (``what``: the reason, or the empty pool)."""

    def __init__(self, api: Api, period_s: float = 1.0) -> None:
        self.api = api
        self.period_s = period_s
        self.pools: Pools | None = None
        self.left: dict[str, float] = {}
        self.first_seen: dict[str, float] = {}
        self.not_ready: list[Interval] = []
        self.empty_pools: list[Interval] = []
        self.num_errors = 0  # polls that failed (the server did not answer in time)
        self._open: dict[str, tuple[float, str]] = {}  # what -> (since, reason)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        now = time.monotonic()
        for key, (since, why) in self._open.items():
            (self.not_ready if key == "ready" else self.empty_pools).append(
                Interval(since, now, why)
            )
        self._open.clear()

    async def poll(self) -> Pools:
        pools = await self.api.pools()
        now = time.monotonic()
        if self.pools is not None:
            for node_id in self.pools.ids - pools.ids:
                self.left.setdefault(node_id, now)
        self.pools = pools
        for node_id in pools.ids:
            self.first_seen.setdefault(node_id, now)
        for role in ROLES:
            self._track(f"pool:{role}", not pools.of(role), now, role)
        return pools

    async def _run(self) -> None:
        while True:
            try:
                await self.poll()
                ready, why = await self.api.readiness()
                self._track("ready", not ready, time.monotonic(), why)
            except (httpx.HTTPError, KeyError, ValueError):
                self.num_errors += 1
            await asyncio.sleep(self.period_s)

    def _track(self, key: str, is_bad: bool, now: float, why: str) -> None:
        if is_bad and key not in self._open:
            self._open[key] = (now, why)
        elif not is_bad and key in self._open:
            since, reason = self._open.pop(key)
            (self.not_ready if key == "ready" else self.empty_pools).append(
                Interval(since, now, reason)
            )


def _stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/pid/stat`` after the command (state, ppid, pgrp, session, ...)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def child_pids(pid: int) -> list[int]:
    """The children of ``pid`` (of every thread of it), from /proc; [] if it is gone."""
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(p) for p in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []
    return kids


def is_alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (FileNotFoundError, ProcessLookupError):
        return None


def listening_ports(pid: int | str = "self") -> list[int]:
    """The TCP ports process ``pid`` listens on (from /proc: its socket fds in the LISTEN
    table; no traffic)."""
    inodes, rows = _sockets(pid)
    return sorted(mine for mine, _, state, inode in rows if state == "0A" and inode in inodes)


def _sockets(pid: int | str) -> tuple[set[str], list[tuple[int, int, str, str]]]:
    """Process ``pid``'s socket inodes, and its network namespace's TCP table as (local port,
    peer port, state, inode) rows (``/proc/net/tcp``; state ``01`` ESTABLISHED, ``0A``
    LISTEN)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    lines = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    return inodes, [(_port(f[1]), _port(f[2]), f[3], f[9]) for f in map(str.split, lines)]


def held_from(pid: int, ports: set[int], closed: bool = False) -> dict[tuple[int, str], int]:
    """Connections process ``pid`` still holds (its socket fds) whose peer is one of ``ports``
    of 127.0.0.1 (a client's local ports), counted by (its own port, TCP state: ``CLOSE_WAIT``
    is one its peer closed): empty once it closed them all, or is gone.

    ``closed``: the clients closed every one of theirs, so each connection still held is in
    ``CLOSE_WAIT`` (its client's FIN arrived) and one ``ESTABLISHED`` is another client's that
    took the same port pair again: on loopback Linux reuses a pair in TIME_WAIT at once, so a
    process that closed a stranger first sees a new peer of its own (the server reconnecting,
    a new node, the soak's next request) arrive from the stranger's port. Not counted."""
    try:
        inodes, rows = _sockets(pid)
    except (FileNotFoundError, ProcessLookupError):
        return {}
    held: dict[tuple[int, str], int] = {}
    for mine, peer, state, inode in rows:
        if inode in inodes and peer in ports and not (closed and state == "01"):
            key = (mine, _TCP_STATES.get(state, state))
            held[key] = held.get(key, 0) + 1
    return held


def _port(address: str) -> int:
    """The port of a ``/proc/net/tcp`` address (``0100007F:1F90``)."""
    return int(address.split(":")[1], 16)


_TCP_STATES = {"01": "ESTABLISHED", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT"}


class ProcessTree:
    """The processes the soak may signal: ``root`` (the ``pd serve`` process) and its
    descendants, alive. ``root`` None: none (a server the soak attached to, without
    ``--server-pid``)."""

    def __init__(self, root: int | None) -> None:
        self.root = root

    def owns(self, pid: int) -> bool:
        if self.root is None or pid <= 1 or not is_alive(pid):
            return False
        for _ in range(64):  # up the parent chain
            if pid == self.root:
                return True
            fields = _stat(pid)
            if fields is None or (pid := int(fields[1])) <= 1:
                return False
        return False

    def signal(self, pid: int, sig: int) -> bool:
        """Send ``sig`` to ``pid`` if it is one of ours; False if it is not (or is gone)."""
        if not self.owns(pid):
            return False
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True


def serve_flags() -> set[str]:
    """The flags this checkout's ``pd serve`` takes (the soak passes newer ones only where
    they exist)."""
    out = subprocess.run(
        [sys.executable, "-m", "pd.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    return set(re.findall(r"(--[a-z][a-z0-9-]+)", out))


class ServeProcess:
    """``pd serve --port PORT *args`` in a session of its own (output to ``log``). ``end()``
    stops it (SIGINT, then SIGKILL) and then every process left in its session (Ray's), by
    pid: nothing else."""

    def __init__(self, args: list[str], port: int, log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        cmd = [sys.executable, "-m", "pd.cli", "serve", "--port", str(port), *args]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.pid = self.proc.pid  # also its session id

    def tail(self, num_chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-num_chars:]

    def session(self) -> list[int]:
        """Live processes of the server's session (it and what it started), but the server."""
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != self.pid:
                fields = _stat(int(entry))
                if fields is not None and fields[0] != "Z" and int(fields[3]) == self.pid:
                    pids.append(int(entry))
        return pids

    def end(self, grace_s: float = 60.0) -> int | None:
        """Stop the server (its exit status; None if it had to be killed) and its session."""
        code: int | None = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while (left := self.session()) and time.monotonic() < deadline:
            time.sleep(0.5)  # Ray's processes exit on their own once the driver is gone
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return code
