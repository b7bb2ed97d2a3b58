"""`ray up` of ``ray_cluster.onprem.yaml`` on hosts in network namespaces
(``pdtools/netns_ray.py``): a head and a prefill and a decode worker; waits for Ctrl-C and
prints the ``ray exec`` to run from the launcher. Root only.

    sudo .venv/bin/python scripts/netns_ray.py --hosts 3
"""

from __future__ import annotations

import argparse
import shlex
import sys

from pdtools.netns_hosts import NetnsHosts, wait_for_interrupt
from pdtools.netns_ray import PD_SERVE, OnpremCluster


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--hosts", type=int, default=3, help="a head, then prefill and decode workers in turn"
    )
    args = parser.parse_args()
    with NetnsHosts() as hosts:
        head, *workers = hosts.start(args.hosts)
        roles = [{"prefill": 1.0}, {"decode": 1.0}]
        cluster = OnpremCluster(hosts, head, {h.index: roles[i % 2] for i, h in enumerate(workers)})
        print(f"ray up took {cluster.up():.1f} s; {cluster.yaml}:", flush=True)
        for host in hosts.hosts:
            role = cluster.workers.get(host.index, "head")
            print(f"  {host.ns} {host.ip} {role}")
        ray = shlex.join(["ray", "exec", str(cluster.yaml), PD_SERVE])
        print(f"from the launcher: {ray}; Ctrl-C to tear down", flush=True)
        wait_for_interrupt()
    return 0


if __name__ == "__main__":
    sys.exit(main())
