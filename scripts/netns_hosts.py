"""Hosts in network namespaces (``pdtools/netns_hosts.py``): make them and wait for Ctrl-C, or
remove what a killed run left behind. Root only.

    sudo .venv/bin/python scripts/netns_hosts.py up --hosts 3
    sudo .venv/bin/python scripts/netns_hosts.py down
"""

from __future__ import annotations

import argparse
import shlex
import sys

from pdtools.netns_hosts import NetnsHosts, cleanup_leftovers, wait_for_interrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="make the hosts, wait for Ctrl-C, undo everything")
    up.add_argument("--hosts", type=int, default=3)
    sub.add_parser("down", help="remove what a killed run left behind")
    args = parser.parse_args()
    if args.cmd == "down":
        cleanup_leftovers()
        return 0
    with NetnsHosts() as hosts:
        for host in hosts.start(args.hosts):
            print(f"{host.ns}: {host.ip}  ({shlex.join(hosts.ssh_args(host, '')[:-1])})")
        print("hosts up; Ctrl-C to remove them", flush=True)
        wait_for_interrupt()
    return 0


if __name__ == "__main__":
    sys.exit(main())
