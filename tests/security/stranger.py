"""A process that does not know the cluster secret: ``python -m tests.security.stranger``.

It reads a JSON list of actions on stdin, does them in order, and exits 0 once every frame is
on the wire (or 1, with the error on stderr):

- ``{"push": endpoint, "frames": [hex, ...]}``: a PUSH socket sends each frame (as a node or
  the server would to a PULL socket)
- ``{"dealer": endpoint, "frames": [hex, ...]}``: a DEALER sends each frame (as a peer would
  to a transfer control ROUTER)
- ``{"store": [host, port], "set": {key: hex}}``: a TCPStore client sets each key

It imports nothing of pd or transfer: all it has is what the test hands it (unsigned messages,
random bytes, frames captured off the wire).
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from typing import Any


def _send(kind: int, endpoint: str, frames: list[str], ctx: Any) -> None:
    import zmq

    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 10_000)  # close() waits until every frame is delivered
    sock.connect(endpoint)
    for frame in frames:
        sock.send(bytes.fromhex(frame))
    sock.close()


def main() -> None:
    import zmq

    ctx = zmq.Context()
    for action in json.load(sys.stdin):
        if "push" in action:
            _send(zmq.PUSH, action["push"], action["frames"], ctx)
        elif "dealer" in action:
            _send(zmq.DEALER, action["dealer"], action["frames"], ctx)
        elif "store" in action:
            import torch.distributed as dist

            host, port = action["store"]
            store = dist.TCPStore(host, port, None, False, timedelta(seconds=10))
            for key, value in action["set"].items():
                store.set(key, bytes.fromhex(value))
        else:
            raise ValueError(f"unknown action {sorted(action)}")
    ctx.term()


if __name__ == "__main__":
    main()
