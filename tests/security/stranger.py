"""A process that does not know the cluster secret: ``python -m tests.security.stranger``.

It reads a JSON list of actions on stdin, does them in order, prints a JSON list with one result
per action on stdout, and exits 0 once every frame is on the wire (or 1, with the error on
stderr):

- ``{"push": endpoint, "frames": [hex, ...]}``: a PUSH socket sends each frame (as a node or
  the server would to a PULL socket)
- ``{"dealer": endpoint, "frames": [hex, ...], "listen_s": s}``: a DEALER sends each frame (as
  a peer would to a transfer control ROUTER), then counts what comes back for ``listen_s``
  seconds (default 0); result: ``{"num_received": n}``
- ``{"push": endpoint, "frames": [], "zeros": [n, ...]}``: as ``push``, then frames of ``n``
  zero bytes each (too long to hand over as hex)
- ``{"probe_stores": [[host, port], ...], "timeout_s": s}``: at each host:port at once, a
  TCPStore client tries to list the keys, read the first and write one; result:
  ``{"probes": [{"port": p, "answered": bool, "keys": [...], "error": str}, ...]}``
  (``answered`` false when it failed or got no answer within ``timeout_s``)
- ``{"flood": [{"to": endpoint, "kind": "push" | "dealer", "frames": [hex, ...],
  "zeros": [n, ...], "connections": k, "every": e}, ...], "seconds": s, "max_frames": m}``:
  round-robin over the targets (``k`` sockets each, default 1; a target sends once in ``e``
  rounds, default every one), each sending its frames in turn (and frames of ``n`` zero bytes
  among them), never blocking (a full queue skips), until ``seconds`` pass or ``m`` frames
  went to each target (default: no limit), keeps its connections open ``hold_s`` seconds
  more (default 0: a receiver that does not read holds what they sent), then waits up to
  ``linger_s`` (default 10) for its queues to drain; result: ``{"num_sent": [n, ...]}``
  per target (every frame counted is delivered before the exit, but to a receiver that drops
  the connection: frames over its size limit)

It imports nothing of pd or transfer: all it has is what the test hands it (unsigned messages,
random bytes, frames captured off the wire).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any


def _send(
    kind: int,
    endpoint: str,
    frames: list[str],
    ctx: Any,
    listen_s: float = 0.0,
    zeros: tuple[int, ...] = (),
) -> int:
    import zmq

    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 10_000)  # close() waits until every frame is delivered
    sock.connect(endpoint)
    for frame in frames:
        sock.send(bytes.fromhex(frame))
    for n in zeros:
        sock.send(bytes(n))
    num_received = 0
    end = time.monotonic() + listen_s
    while (left := end - time.monotonic()) > 0:
        if sock.poll(int(left * 1000) + 1):
            sock.recv_multipart()
            num_received += 1
    sock.close()
    return num_received


def _probe_stores(addrs: list[list[Any]], timeout_s: float) -> dict[str, Any]:
    import torch.distributed as dist

    probes = [_probe(dist, host, port, timeout_s) for host, port in addrs]
    end = time.monotonic() + timeout_s + 1.0
    # A TCPStore client talking to something else (a gloo or zmq port) may wait forever.
    for thread, _ in probes:
        thread.join(max(end - time.monotonic(), 0.0))
    return {"probes": [dict(result) for _, result in probes]}  # as they stand now


def _probe(dist: Any, host: str, port: int, timeout_s: float) -> tuple[threading.Thread, Any]:
    result: dict[str, Any] = {"port": port, "answered": False, "keys": [], "error": "no answer"}

    def probe() -> None:
        try:
            store = dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s))
            keys = store.list_keys()
            if keys:
                store.get(keys[0])
            store.set("stranger/was-here", b"1")
            result.update(answered=True, keys=keys, error="")
        except Exception as e:  # refused, reset, timed out: no store there
            result["error"] = f"{type(e).__name__}: {str(e)[:200]}"

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    return thread, result


def _flood(
    targets: list[dict[str, Any]],
    seconds: float,
    max_frames: float,
    linger_s: float,
    ctx: Any,
    hold_s: float = 0.0,
) -> Any:
    import zmq

    socks = []
    for i, spec in enumerate(targets):
        frames = [bytes.fromhex(f) for f in spec["frames"]] + [
            bytes(n) for n in spec.get("zeros", [])
        ]
        for _ in range(spec.get("connections", 1)):
            sock = ctx.socket(zmq.PUSH if spec["kind"] == "push" else zmq.DEALER)
            sock.setsockopt(zmq.LINGER, int(linger_s * 1000))
            sock.setsockopt(zmq.SNDHWM, 1000)
            sock.connect(spec["to"])
            socks.append((i, sock, frames, spec.get("every", 1)))
    sent = [0] * len(targets)
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end and min(sent) < max_frames:
        num_sent = 0
        for i, sock, frames, every in socks:
            if sent[i] >= max_frames or n % every:
                continue
            try:
                sock.send(frames[n % len(frames)], zmq.NOBLOCK)
                sent[i] += 1
                num_sent += 1
            except zmq.Again:  # its queue is full (the receiver is behind, or reconnecting)
                pass
        n += 1
        if not num_sent:  # every queue is full: wait for the receivers, do not spin
            time.sleep(0.001)
    time.sleep(hold_s)
    for _, sock, _, _ in socks:
        sock.close()  # what it queued is delivered by ctx.term()
    return {"num_sent": sent}


def main() -> None:
    import zmq

    ctx = zmq.Context()
    results: list[dict[str, Any]] = []
    for action in json.load(sys.stdin):
        if "push" in action:
            _send(zmq.PUSH, action["push"], action["frames"], ctx, zeros=action.get("zeros", ()))
            results.append({})
        elif "dealer" in action:
            n = _send(
                zmq.DEALER, action["dealer"], action["frames"], ctx, action.get("listen_s", 0)
            )
            results.append({"num_received": n})
        elif "probe_stores" in action:
            results.append(_probe_stores(action["probe_stores"], action.get("timeout_s", 3.0)))
        elif "flood" in action:
            max_frames = action.get("max_frames", float("inf"))
            linger_s = action.get("linger_s", 10.0)
            hold_s = action.get("hold_s", 0.0)
            results.append(
                _flood(action["flood"], action["seconds"], max_frames, linger_s, ctx, hold_s)
            )
        else:
            raise ValueError(f"unknown action {sorted(action)}")
    ctx.term()  # every frame sent is delivered first (LINGER)
    print(json.dumps(results), flush=True)
    # a store probe stuck in a foreign port's handshake must not hold the exit
    os._exit(0)


if __name__ == "__main__":
    main()
