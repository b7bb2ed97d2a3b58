"""The processes of the netns harness (``pdtools.netns_hosts``), read from ``/proc`` and ended
with SIGKILL: only ever pids the harness started or found in its own namespaces.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path


def wait_port(host: str, port: int, timeout_s: float, what: str) -> None:
    """Until ``host:port`` takes a connection; TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{what} did not listen on {host}:{port} in {timeout_s} s"
                ) from None
            time.sleep(0.05)


def child_of(pid: int) -> int | None:
    """``pid``'s first child, if it has one."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def is_live(pid: int) -> bool:
    """``pid`` runs (it exists and is no zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def cmdline(pid: int) -> str:
    """``pid``'s command line ("?" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"


def kill_pid(pid: int) -> None:
    """SIGKILL ``pid``, if it is still there."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def end(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a process this harness started (with --kill-child, its namespace goes too)."""
    if proc.poll() is None:
        kill_pid(proc.pid)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pass
