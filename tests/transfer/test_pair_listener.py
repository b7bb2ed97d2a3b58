"""Strangers at a gloo pair's listener, against a real process holding pair groups: 200
connections that close at once (half after sending 8 random bytes, what gloo reads as a
sequence number). The process's descriptors stay at their count and none of its sockets is
left in ``CLOSE_WAIT`` (before: gloo kept each one for the pair's life); its pair still moves
tensors and a new pair forms after."""

from __future__ import annotations

import json
import os
import selectors
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(90)

NUM_STRANGERS = 200
CONNECT_WAIT_S = 1.0  # for the strangers' connections to be accepted (or not)
SETTLE_S = 5.0  # for the process to close what it accepted (2 shared cores)
_CLOSE_WAIT = "08"
_LISTEN = "0A"

_CHILD = """
import json, os, sys, threading
import torch, torch.distributed as dist
from transfer.group import TorchPairGroup

def pair(name):
    store, groups = dist.HashStore(), [None, None]
    def make(rank):
        groups[rank] = TorchPairGroup("gloo", store=store, prefix=name, rank=rank,
                                      timeout_s=20.0, device=torch.device("cpu"))
    threads = [threading.Thread(target=make, args=(rank,)) for rank in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return groups

def moves(groups):
    sent, got = torch.arange(8.0), torch.zeros(8)
    a, b = groups[0].isend(sent), groups[1].irecv(got)
    a.wait(10.0)
    b.wait(10.0)
    return bool(torch.equal(sent, got))

first = pair("a")
print(json.dumps({"moves": moves(first)}), flush=True)
sys.stdin.readline()
second = pair("b")
print(json.dumps({"moves": moves(first) and moves(second)}), flush=True)
sys.stdin.readline()
"""


def _sockets(pid: int) -> dict[str, tuple[int, str]]:
    """The TCP sockets of process ``pid``: inode -> (local port, state)."""
    inodes = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = {}
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = row.split()
            if cols[9] in inodes:
                out[cols[9]] = (int(cols[1].rsplit(":", 1)[1], 16), cols[3])
    return out


def _num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _strangers(ports: list[int]) -> int:
    """``NUM_STRANGERS`` connections spread over ``ports``, each closed after
    ``CONNECT_WAIT_S`` (every other one after sending 8 random bytes); how many connected."""
    sel = selectors.DefaultSelector()
    conns = []
    for i in range(NUM_STRANGERS):
        conn = socket.socket()
        conn.setblocking(False)
        conn.connect_ex(("127.0.0.1", ports[i % len(ports)]))
        sel.register(conn, selectors.EVENT_WRITE, i)
        conns.append(conn)
    num_connected = 0
    end = time.monotonic() + CONNECT_WAIT_S
    while sel.get_map() and (left := end - time.monotonic()) > 0:
        for key, _ in sel.select(left):
            conn: Any = key.fileobj
            sel.unregister(conn)
            if conn.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                num_connected += 1
                if key.data % 2:
                    conn.send(os.urandom(8))
    for conn in conns:
        conn.close()
    sel.close()
    return num_connected


def test_strangers_at_a_pair_listener_leave_no_descriptor_and_a_new_pair_forms() -> None:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdin is not None
        assert json.loads(child.stdout.readline()) == {"moves": True}
        ports = sorted({port for port, state in _sockets(child.pid).values() if state == _LISTEN})
        assert len(ports) == 2, ports  # gloo's listeners: one per rank's device
        num_fds = _num_fds(child.pid)

        num_connected = _strangers(ports)
        deadline = time.monotonic() + SETTLE_S
        while True:
            held = [s for s in _sockets(child.pid).values() if s[1] == _CLOSE_WAIT]
            extra = _num_fds(child.pid) - num_fds
            if (not held and extra <= 0) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        print(
            f"\n{num_connected} of {NUM_STRANGERS} strangers connected; the process holds "
            f"{len(held)} in CLOSE_WAIT, {extra} descriptors more"
        )
        assert held == [] and extra <= 0, (len(held), extra)

        child.stdin.write("next\n")
        child.stdin.flush()
        assert json.loads(child.stdout.readline()) == {"moves": True}  # the old pair, a new one
    finally:
        child.kill()
        child.wait(10)
