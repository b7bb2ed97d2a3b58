"""Stop this machine's Ray once the head's has been stopped: what `ray down` does not do.

With Ray's on-prem (``local``) provider, ``ray down`` runs ``ray stop`` on the head alone. A
worker's raylet gives up on the head 60 s later, and Ray's log monitor and agents outlive it.
``ray_cluster.onprem.yaml`` starts this beside each worker's Ray: when the head machine
*refuses* connections to Ray's port for ``--grace-s`` (its Ray is stopped, or restarted, which
also ends this machine's membership), it runs ``ray stop`` here. A head it cannot reach at all
(a partition: timeouts, no route) is left to Ray's own timeouts, so a network fault never
stops a worker by itself.

The file name ends in ``monitor.py`` on purpose: ``ray stop`` ends processes whose command line
holds ``monitor.py`` (Ray's own autoscaler monitor), so a ``ray stop`` here, a restart's
included, ends this one with the rest of the machine's Ray, and a new one starts with it.
Usage: ``python ray_head_monitor.py HEAD_IP:PORT [--grace-s 6] [--interval-s 1]``.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

UP, REFUSED, UNREACHABLE = "up", "refused", "unreachable"


def probe(host: str, port: int, timeout_s: float = 2.0) -> str:
    """``up`` (it accepts), ``refused`` (the machine answers, nothing listens), else
    ``unreachable``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return UP
    except ConnectionRefusedError:
        return REFUSED
    except OSError:
        return UNREACHABLE


def follow(
    check: Callable[[], str], grace_s: float, interval_s: float, sleep: Callable[[float], None]
) -> None:
    """Return once ``check()`` has said ``refused`` at every look for ``grace_s``."""
    refused_since: float | None = None
    now = 0.0
    while True:
        if check() == REFUSED:
            refused_since = now if refused_since is None else refused_since
            if now - refused_since >= grace_s:
                return
        else:
            refused_since = None
        sleep(interval_s)
        now += interval_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("head", help="HOST:PORT of the head's Ray (GCS)")
    parser.add_argument("--grace-s", type=float, default=6.0)
    parser.add_argument("--interval-s", type=float, default=1.0)
    args = parser.parse_args()
    host, _, port = args.head.rpartition(":")
    follow(lambda: probe(host, int(port)), args.grace_s, args.interval_s, time.sleep)
    print(f"{args.head} refused connections for {args.grace_s} s: ray stop", flush=True)
    ray = Path(sys.executable).parent / "ray"
    return subprocess.run([str(ray), "stop"], timeout=120).returncode


if __name__ == "__main__":
    sys.exit(main())
