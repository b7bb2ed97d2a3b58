"""Hostile peers at the nodes' own sockets, for ``scripts/chaos_soak.py``: junk frames at an
internal zmq socket (``junk_frames``), as a process without the cluster secret can send them,
and strangers' TCP connections to every port of a node (``hold_strangers``). Both block (run
them in a thread) and are bounded.
"""

from __future__ import annotations

import random
import selectors
import socket
import time

CONNECT_WAIT_S = 2.0  # for all of ``hold_strangers``' connects together


def junk_frames(
    endpoints: list[tuple[str, str]], num_frames: int, big_bytes: int, seed: int
) -> int:
    """Send ``num_frames`` random frames (and two of ``big_bytes``) to each (kind, endpoint):
    kind ``push`` for a PULL socket (a node's inbox), ``dealer`` for a ROUTER (a transfer
    control port). Blocking, bounded (each send waits 2 s at most). Returns frames sent."""
    import msgspec
    import zmq

    rng = random.Random(seed)
    unsealed = [  # well-formed messages without the seal: what a stranger would try first
        msgspec.msgpack.encode({"type": "abort", "request_id": f"r{i}"}) for i in range(8)
    ] + [msgspec.msgpack.encode(["prefill", {"request_id": "x", "prompt": [1, 2, 3]}])]
    ctx = zmq.Context()
    num_sent = 0
    try:
        for kind, endpoint in endpoints:
            sock = ctx.socket(zmq.PUSH if kind == "push" else zmq.DEALER)
            sock.setsockopt(zmq.SNDTIMEO, 2000)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(endpoint)
            frames = [rng.randbytes(rng.randint(1, 300)) for _ in range(num_frames)]
            step = max(1, num_frames // len(unsealed))
            for i, msg in enumerate(unsealed[: len(frames[::step])]):
                frames[i * step] = msg
            frames += [rng.randbytes(big_bytes), b"\x00" * big_bytes]
            try:
                for frame in frames:
                    sock.send(frame)
                    num_sent += 1
            except zmq.Again:  # the peer takes no more (gone, or its queue full): bounded
                pass
            sock.close()
    finally:
        ctx.term()
    return num_sent


def hold_strangers(
    ports: list[int], num: int, hold_s: float, seed: int
) -> tuple[set[int], int, int]:
    """``num`` TCP connections to 127.0.0.1's ``ports`` in turn, every third sending junk (a
    ZMTP greeting's start, HTTP, random bytes), held ``hold_s``, then closed. Blocking,
    bounded (the connects wait ``CONNECT_WAIT_S`` at most, together: a port that drops them, a
    gloo pair's listener once connected, costs no more). Returns (the connections' own ports,
    how many sent junk, how many were refused or not accepted in time)."""
    rng = random.Random(seed)
    junk = [b"\xff" + bytes(8) + b"\x7f\x03", b"GET / HTTP/1.1\r\n\r\n", rng.randbytes(512)]
    pending: dict[socket.socket, int] = {}  # connecting, by their index
    socks: list[socket.socket] = []
    mine: set[int] = set()
    num_junk = 0
    sel = selectors.DefaultSelector()
    try:
        for i in range(num):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", ports[i % len(ports)]))
            pending[sock] = i
            sel.register(sock, selectors.EVENT_WRITE)
        end = time.monotonic() + CONNECT_WAIT_S
        while pending and (left := end - time.monotonic()) > 0:
            for key, _ in sel.select(left):
                sock = key.fileobj  # type: ignore[assignment]
                i = pending.pop(sock)
                sel.unregister(sock)
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
                    sock.close()
                    continue
                sock.setblocking(True)
                socks.append(sock)
                mine.add(sock.getsockname()[1])
                if i % 3 == 0:
                    try:
                        sock.sendall(junk[(i // 3) % len(junk)])
                        num_junk += 1
                    except OSError:
                        pass
        num_refused = num - len(socks)
        time.sleep(hold_s)
    finally:
        sel.close()
        for sock in [*pending, *socks]:
            sock.close()
    return mine, num_junk, num_refused
