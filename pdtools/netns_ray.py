"""`ray up` of ``ray_cluster.onprem.yaml`` on the hosts of ``netns_hosts``.

``render_onprem`` edits the yaml the way its comments tell a person to (the head's and the
workers' addresses, the role table, the pd checkout's path, ssh_user and the key) and changes nothing
else; ``OnpremCluster`` runs Ray's own commands on it from the launcher, as the README's "Run
on your own machines" does: ``ray get-auth-token --generate``, ``ray up -y``, ``ray exec`` (of
``pd serve``), ``ray up -y --no-restart`` after adding a worker, ``ray down -y``.

By hand (root): ``.venv/bin/python scripts/netns_ray.py --hosts 3`` brings up a head and a
prefill and a decode worker and waits for Ctrl-C; ``ray exec`` from the launcher is printed.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from pdtools.netns_hosts import REPO, ROOT, HarnessError, Host, NetnsHosts

TEMPLATE = REPO / "ray_cluster.onprem.yaml"
EXAMPLE_HEAD = "10.0.0.10"
EXAMPLE_CHECKOUT = "/opt/pd"  # the pd checkout; its venv is <checkout>/.venv
_TABLE = re.compile(
    r"(case \$ip in\n)((?: +\S+\) resources='.*' ;;\n)*)( +\*\) resources='\{\}' ;;)"
)
Resources = Mapping[str, float]
# README "Run on your own machines" runs these; the tests add their flags (model, timeouts)
PORT = 8000
PD_SERVE = (
    f"pd serve --address auto --host 0.0.0.0 --port {PORT} --prefill 1 --decode 1 "
    '--prefill-resources "{\\"prefill\\": 1}" --decode-resources "{\\"decode\\": 1}"'
)


def render_onprem(
    head_ip: str,
    workers: Mapping[str, Resources],
    checkout: str,
    ssh_user: str,
    ssh_key: str,
    template: str | None = None,
) -> str:
    """``ray_cluster.onprem.yaml`` for these machines: ``workers`` maps each worker's address
    to the custom resources it offers (its role)."""
    text = TEMPLATE.read_text() if template is None else template
    table = "".join(
        f"      {ip}) resources='{json.dumps(dict(res))}' ;;\n" for ip, res in workers.items()
    )
    edits: list[tuple[str, Callable[[re.Match[str]], str]]] = [
        (_TABLE.pattern, lambda m: m[1] + table + m[3]),
        (r"^  worker_ips: \[.*\]$", lambda m: f"  worker_ips: [{', '.join(workers)}]"),
        (re.escape(EXAMPLE_HEAD), lambda m: head_ip),
        (re.escape(EXAMPLE_CHECKOUT), lambda m: checkout),
        (r"^  ssh_user: .*$", lambda m: f"  ssh_user: {ssh_user}"),
        (r"^  ssh_private_key: .*$", lambda m: f"  ssh_private_key: {ssh_key}"),
    ]
    for pattern, new in edits:
        text, n = re.subn(pattern, new, text, flags=re.M)
        if n == 0:
            raise ValueError(f"{TEMPLATE.name} has no {pattern!r} to edit")
    return text


class OnpremCluster:
    """Ray on ``head`` and ``workers`` (host index -> its resources), brought up with ``ray up``.
    A worker may be listed before its host exists: it joins once made (``wait_joined``)."""

    def __init__(self, hosts: NetnsHosts, head: Host, workers: dict[int, Resources]) -> None:
        self.hosts = hosts
        self.head = head
        self.workers = dict(workers)  # host index -> resources
        self.yaml = ROOT / "ray_cluster.onprem.yaml"
        self.log = ROOT / "launcher.log"

    def render(self) -> None:
        by_ip = {Host(i).ip: res for i, res in self.workers.items()}  # made yet or not
        key = str(ROOT / "ssh" / "id_ed25519")
        self.yaml.write_text(render_onprem(self.head.ip, by_ip, str(REPO), "root", key))

    def up(self, wait_for: list[int] | None = None, timeout_s: float = 180) -> float:
        """``ray get-auth-token --generate`` and ``ray up``, then wait until the workers in
        ``wait_for`` (default: all) have joined. Returns the seconds it took."""
        start = time.monotonic()
        self.render()
        self.hosts.launcher(["ray", "get-auth-token", "--generate"], self.log, timeout=60)
        self.hosts.launcher(["ray", "up", "-y", str(self.yaml)], self.log, timeout=timeout_s)
        for index in self.workers if wait_for is None else wait_for:
            self.wait_joined(index, start + timeout_s - time.monotonic())
        return time.monotonic() - start

    def wait_joined(self, index: int, timeout_s: float) -> float:
        """Wait until host ``index`` has run the yaml's worker start commands (the last one
        starts its ``ray_head_monitor.py``): Ray's autoscaler on the head set it up."""
        start = time.monotonic()
        while not self.runs(self._host(index), "ray_head_monitor.py"):
            if time.monotonic() - start > timeout_s:
                raise HarnessError(
                    f"host {index} did not join the Ray cluster in {timeout_s:.0f} s"
                )
            time.sleep(0.2)
        return time.monotonic() - start

    def serve(self, extra: str, log: Path) -> subprocess.Popen[bytes]:
        """``ray exec`` of ``PD_SERVE`` + ``extra`` on the head, left running; end it with
        ``hosts.stop_launched`` (its ssh session ends: pd serve gets SIGHUP)."""
        command = f"{PD_SERVE} {extra}"
        return self.hosts.launcher(["ray", "exec", str(self.yaml), command], log, wait=False)

    def down(self, timeout_s: float = 120) -> None:
        self.hosts.launcher(["ray", "down", "-y", str(self.yaml)], self.log, timeout=timeout_s)

    def runs(self, host: Host, text: str) -> bool:
        """A live process of the host has ``text`` in its command line."""
        return any(text in line for line in self.hosts.processes(host))

    def _host(self, index: int) -> Host:
        return self.hosts.hosts[index - 1]
