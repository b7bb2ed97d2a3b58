"""Start ``pd serve`` as a subprocess for one benchmark run, then stop it and everything it spawned.

Used by ``bench_serving.py --launch "label=ARGS"``: each launch gets a free loopback port, its
own session (so Ray's workers, which change process group, are still ours to stop), and a log
file; ``launched()`` yields the server's base URL once it printed "pd is serving".
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

_REPO = Path(__file__).resolve().parents[1]
_SERVING = re.compile(r"pd is serving (http://127\.0\.0\.1:\d+)/v1")
_OWNED_FLAGS = ("--host", "--port")  # the launcher picks these: loopback and a free port
_LABEL = re.compile(r"^([A-Za-z0-9_.:-]+)=(.*)$", re.S)


class Launch(NamedTuple):
    label: str
    args: list[str]  # arguments of `pd serve`, without --host/--port


def parse_launch(spec: str) -> Launch:
    """``"label=--prefill 2 ..."`` or ``"--prefill 2 ..."`` (the label is then the args)."""
    m = _LABEL.match(spec.strip())
    label, rest = (m.group(1), m.group(2)) if m else (spec.strip(), spec)
    args = shlex.split(rest)
    for a in args:
        if a.split("=")[0] in _OWNED_FLAGS:
            raise ValueError(f"--launch {spec!r}: {a.split('=')[0]} is set by the launcher")
    return Launch(label, args)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(path: Path, num_lines: int = 40) -> str:
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-num_lines:])


def _wait_serving(proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if m := _SERVING.search(log.read_text(errors="replace")):
            return m.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"pd serve exited with code {proc.returncode} before serving")
        time.sleep(0.5)
    raise TimeoutError(f"pd serve did not print 'pd is serving' within {timeout_s:.0f} s")


def _session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (Linux /proc; the session is the one we created)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp sid
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def stop(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGINT to the server's process group (a clean Ray shutdown), SIGKILL after ``grace_s``;
    then SIGKILL whatever is left of its session (Ray workers sit in their own groups)."""
    sid = proc.pid  # start_new_session: the server leads its session and process group
    if proc.poll() is None:
        os.killpg(sid, signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(sid, signal.SIGKILL)
            proc.wait(10)
    for _ in range(20):  # bounded: stragglers get 10 s to die
        left = _session_pids(sid)
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
    print(f"warning: processes of session {sid} still alive: {_session_pids(sid)}", file=sys.stderr)


@contextmanager
def launched(launch: Launch, start_timeout_s: float = 300.0) -> Iterator[str]:
    """Run ``python -m pd.cli serve --host 127.0.0.1 --port P ARGS``; yield its base URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "pd.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += launch.args
    fd, name = tempfile.mkstemp(prefix=f"pd-serve-{launch.label}-", suffix=".log")
    log = Path(name)
    print(f"[{launch.label}] {shlex.join(cmd)}  (log: {log})", file=sys.stderr, flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with os.fdopen(fd, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=_REPO, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        t0 = time.monotonic()
        try:
            url = _wait_serving(proc, log, start_timeout_s)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"[{launch.label}] {e}; log tail:\n{_log_tail(log)}") from e
        print(
            f"[{launch.label}] serving {url} after {time.monotonic() - t0:.0f} s", file=sys.stderr
        )
        yield url
    finally:
        stop(proc)
