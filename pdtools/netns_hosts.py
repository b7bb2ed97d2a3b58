"""Hosts in network namespaces: a cluster of machines on one machine, for `ray up` and pd.

Each host is a network namespace (``pdh1``, ``pdh2``, ...) on the bridge ``pdbr0`` with an
address of its own (10.77.0.11, .12, ...; this machine is 10.77.0.1 on the bridge, and no host
has a default route), and an sshd that runs as PID 1 of a PID namespace of its own: everything
started through it (Ray, pd's nodes) lives there, so ``ray stop`` on one host sees only that
host's processes, and killing the namespace's PID 1 kills the whole host. Each host also has a
private ``/root``, ``/tmp`` and ``/dev/shm`` (Ray's session files, sockets and object store stay
per host, apart from this machine's own Ray); only the Python the venv links to and the
harness's directory (``/tmp/pd-netns``: keys, configs, the model) are bound back in. The
*launcher* runs commands (``ray up``, ``ray exec``, ``ray down``) the way a person does from a
machine of their own: this machine's network, a private home and ``/tmp``, a PID namespace that
ends with the command.

Only namespaces, links and processes this harness made are ever touched: it takes a lock (an
abstract socket), refuses a bridge, namespace or subnet it does not own, and ``close()`` (also
when a test fails) kills each host's PID namespace and the launchers it started, deletes the
namespaces, the bridge and its directory. Root only; ``missing_tools()`` names what to install.

By hand: ``sudo .venv/bin/python scripts/netns_hosts.py up --hosts 3`` (until Ctrl-C), and
``... down`` to clean up after a run that was killed. ``netns_ray`` adds `ray up`.
"""

from __future__ import annotations

import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdtools.netns_procs import child_of, cmdline, end, is_live, kill_pid, wait_port

ROOT = Path("/tmp/pd-netns")
BRIDGE = "pdbr0"
NS_PREFIX = "pdh"
SUBNET = "10.77.0"  # /24; this machine is .1, host N is .(10 + N)
_ALIAS = "pd-netns-harness"  # the bridge's alias: ours
_LOCK = b"\0pd-netns-harness"
REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv"
TOOLS = ("ip", "unshare", "ssh", "ssh-keygen", "sshd", "rsync", "ss")
_SSHD = "/usr/sbin/sshd"


class HarnessError(RuntimeError):
    """The harness cannot run here (not root, a tool missing, a name or subnet taken)."""


class HarnessBusy(HarnessError):
    """Another run of this harness holds the machine's namespaces now."""


def missing_tools() -> list[str]:
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [t for t in TOOLS if shutil.which(t, path=path) is None]


def install_tools() -> None:
    """apt-get the harness's tools (root): sshd, ssh and rsync come from these two packages."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-yq", "openssh-server", "rsync"],
    ):
        subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=600)


def sh(*cmd: str, check: bool = True, timeout: float = 30) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise HarnessError(f"{shlex.join(cmd)}: exit {out.returncode}: {out.stderr.strip()}")
    return out.stdout


@dataclass
class Host:
    index: int
    init: subprocess.Popen[bytes] | None = None  # `unshare`: its child is the host's PID 1

    @property
    def ns(self) -> str:
        return f"{NS_PREFIX}{self.index}"

    @property
    def ip(self) -> str:
        return f"{SUBNET}.{10 + self.index}"

    @property
    def link(self) -> str:  # this machine's end of the host's cable, on the bridge
        return f"pdv{self.index}"

    @property
    def dir(self) -> Path:
        return ROOT / f"h{self.index}"


def _private_mounts(private: Path) -> list[str]:
    """Shell lines, run in a new mount namespace, giving it a home, /tmp and /dev/shm of its
    own, with the Python behind the venv, the venv, the repo and ROOT bound back in."""
    home = Path(pwd.getpwuid(os.getuid()).pw_dir)
    python_home = (VENV / "bin" / "python").resolve().parents[1]
    lines = ["set -e", f"mkdir -p {private}/home {private}/tmp"]
    for keep in (python_home, VENV.resolve(), REPO, ROOT):
        for base, where in ((home, f"{private}/home"), (Path("/tmp"), f"{private}/tmp")):
            if keep.is_relative_to(base):
                inside = f"{where}/{keep.relative_to(base)}"
                lines += [f"mkdir -p {inside}", f"mount --bind {keep} {inside}"]
    lines += [
        f"mount --rbind {private}/home {home}",
        f"mount --rbind {private}/tmp /tmp",
        "mount -t tmpfs tmpfs /dev/shm",
    ]
    return lines


@dataclass
class NetnsHosts:
    """``start(n)`` makes n hosts, ``add_host()`` one more; ``close()`` undoes everything."""

    hosts: list[Host] = field(default_factory=list)
    _lock: socket.socket | None = None
    _launched: list[subprocess.Popen[bytes]] = field(default_factory=list)

    # -- life -------------------------------------------------------------------------------

    def start(self, num_hosts: int) -> list[Host]:
        if os.geteuid() != 0:
            raise HarnessError("network namespaces need root")
        if missing := missing_tools():
            raise HarnessError(
                f"missing tools: {', '.join(missing)} (apt-get install openssh-server rsync)"
            )
        self._lock = socket.socket(socket.AF_UNIX)
        try:
            self._lock.bind(_LOCK)
        except OSError:
            self._lock = None
            raise HarnessBusy("another run of the pd netns harness holds this machine") from None
        cleanup_leftovers()
        _check_free()
        (ROOT / "ssh").mkdir(parents=True)
        (ROOT / ".pd-netns").touch()
        key = ROOT / "ssh" / "id_ed25519"
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "pd-netns", "-f", str(key))
        shutil.copy(key.with_suffix(".pub"), ROOT / "ssh" / "authorized_keys")
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "link", "set", BRIDGE, "alias", _ALIAS)
        sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
        sh("ip", "link", "set", BRIDGE, "up")
        for _ in range(num_hosts):
            self.add_host()
        return self.hosts

    def add_host(self) -> Host:
        host = Host(len(self.hosts) + 1)
        self.hosts.append(host)
        host.dir.mkdir(parents=True)
        sh("ip", "netns", "add", host.ns)
        sh("ip", "link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
        sh("ip", "link", "set", host.link, "master", BRIDGE, "up")
        sh("ip", "-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        sh("ip", "-n", host.ns, "link", "set", "lo", "up")
        sh("ip", "-n", host.ns, "link", "set", "eth0", "up")
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host.dir / "host_key"))
        (host.dir / "sshd_config").write_text(
            f"ListenAddress {host.ip}:22\nHostKey {host.dir}/host_key\n"
            f"PidFile {host.dir}/sshd.pid\nAuthorizedKeysFile {ROOT}/ssh/authorized_keys\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nMaxStartups 100\n"
        )
        script = [*_private_mounts(host.dir), f"exec {_SSHD} -D -e -f {host.dir}/sshd_config"]
        cmd = ["ip", "netns", "exec", host.ns, "unshare", "--pid", "--fork", "--mount-proc"]
        with open(host.dir / "sshd.log", "wb") as log:
            host.init = subprocess.Popen(
                [*cmd, "--kill-child", "sh", "-c", "\n".join(script)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        try:
            wait_port(host.ip, 22, timeout_s=15, what=f"sshd of {host.ns}")
        except TimeoutError as e:
            raise HarnessError(str(e)) from None
        return host

    def close(self) -> None:
        """Kill every host and launcher, delete the namespaces, the bridge and ROOT (nothing
        when ``start`` did not get the lock: then they are another run's)."""
        if self._lock is None:
            return
        for proc in self._launched:
            end(proc)
        for host in self.hosts:
            self.kill(host)
        self.hosts.clear()
        cleanup_leftovers()
        self._lock.close()
        self._lock = None

    def save_logs(self, dest: Path) -> None:
        """Copy the harness's logs and each host's Ray logs to ``dest`` (before ``close``)."""
        dest.mkdir(parents=True, exist_ok=True)
        for log in ROOT.glob("*.log"):
            shutil.copy(log, dest / log.name)
        for host in self.hosts:
            for logs in (host.dir / "tmp" / "ray").glob("session_2*/logs"):
                shutil.copytree(logs, dest / host.ns, dirs_exist_ok=True)

    def __enter__(self) -> NetnsHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- faults -----------------------------------------------------------------------------

    def cut(self, host: Host) -> None:
        """Unplug the host's cable: its packets go nowhere, its processes run on."""
        sh("ip", "link", "set", host.link, "down")

    def reconnect(self, host: Host) -> None:
        sh("ip", "link", "set", host.link, "up")

    def kill(self, host: Host) -> None:
        """SIGKILL the host's PID 1: the kernel kills every process of the host with it."""
        if host.init is not None:
            init_pid = child_of(host.init.pid)
            if init_pid is not None:
                os.kill(init_pid, signal.SIGKILL)
            end(host.init)
        deadline = time.monotonic() + 20
        while self.pids(host) and time.monotonic() < deadline:
            time.sleep(0.05)

    # -- looking in -------------------------------------------------------------------------

    def pids(self, host: Host) -> list[int]:
        """Live processes in the host's network namespace (every process of the host)."""
        if not Path(f"/run/netns/{host.ns}").exists():
            return []
        out = sh("ip", "netns", "pids", host.ns, check=False)
        return [int(p) for p in out.split() if is_live(int(p))]

    def processes(self, host: Host) -> list[str]:
        """``pid command line`` of every live process of the host but its sshd listener (the
        PID namespace's PID 1) and the ``unshare`` that waits for it."""
        init = host.init.pid if host.init is not None else None
        skip = {init, child_of(init) if init is not None else None}
        return [f"{p} {cmdline(p)[:200]}" for p in self.pids(host) if p not in skip]

    def sockets(self, host: Host) -> str:
        """The host's TCP sockets with their processes (``ss -tanp``)."""
        return sh("ip", "netns", "exec", host.ns, "ss", "-tanp")

    # -- commands ---------------------------------------------------------------------------

    def ssh_args(self, host: Host, command: str) -> list[str]:
        return [
            "ssh", "-i", str(ROOT / "ssh" / "id_ed25519"), "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=10", f"root@{host.ip}", command,
        ]  # fmt: skip

    def ssh(self, host: Host, command: str, timeout: float = 60) -> str:
        return sh(*self.ssh_args(host, command), timeout=timeout)

    def launcher(
        self, args: list[str], log: Path, wait: bool = True, timeout: float = 300
    ) -> subprocess.Popen[bytes]:
        """Run ``args`` on the launching machine: this machine's network, the venv on PATH, a
        private home and /tmp (Ray's cluster state and ssh sockets), a PID namespace that
        dies with the command (Ray's lingering ssh masters too). ``wait``: until it exits,
        raising on a failure (its log in the message); else it runs on until ``close()``."""
        script = [*_private_mounts(ROOT / "launcher"), "cd " + shlex.quote(str(ROOT)), '"$@"']
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env["PATH"] = f"{VENV / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
        cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--kill-child"]
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [*cmd, "sh", "-c", "\n".join(script), "sh", *args],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip
        if not wait:
            self._launched.append(proc)
            return proc
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            end(proc)
            code = -1
        if code != 0:
            tail = log.read_text(errors="replace")[-3000:]
            raise HarnessError(f"{shlex.join(args)}: exit {code} (timeout {timeout} s)\n{tail}")
        return proc

    def stop_launched(self, proc: subprocess.Popen[bytes]) -> None:
        """End a launcher command started with ``wait=False`` (and all it runs here)."""
        end(proc)
        self._launched.remove(proc)


def cleanup_leftovers() -> None:
    """Remove what a run of this harness made (or left, if it was killed): only when the
    bridge or ROOT says it is ours; a namespace or link named like ours without either is
    refused."""
    ours = (ROOT / ".pd-netns").exists() or _bridge_alias() == _ALIAS
    namespaces = [n.split()[0] for n in sh("ip", "netns", "list").splitlines() if n.strip()]
    mine = [n for n in namespaces if re.fullmatch(rf"{NS_PREFIX}\d+", n)]
    links = re.findall(r"^\d+: (pdv\d+)@", sh("ip", "-o", "link", "show"), re.M)
    if (mine or links) and not ours:
        raise HarnessError(f"{mine + links} exist and are not this harness's")
    if _bridge_alias() not in (None, _ALIAS):
        raise HarnessError(f"a link named {BRIDGE} exists and is not this harness's")
    for ns in mine:
        for pid in sh("ip", "netns", "pids", ns, check=False).split():
            kill_pid(int(pid))  # a process in a namespace only this harness makes
    for link in links:  # both ends at once: a deleted namespace can outlive its name a minute
        sh("ip", "link", "del", link, check=False)
    for ns in mine:
        sh("ip", "netns", "del", ns, check=False)
    if _bridge_alias() == _ALIAS:
        sh("ip", "link", "del", BRIDGE)
    if ROOT.exists():
        for mount in reversed(Path("/proc/self/mounts").read_text().splitlines()):
            if mount.split()[1].startswith(str(ROOT)):  # none expected: mounts live in hosts
                sh("umount", "-l", mount.split()[1], check=False)
        shutil.rmtree(ROOT, ignore_errors=True)


def _check_free() -> None:
    for line in sh("ip", "-o", "route", "show").splitlines():
        if line.startswith(f"{SUBNET}.") or f" via {SUBNET}." in line:
            raise HarnessError(f"{SUBNET}.0/24 is routed here already: {line}")


def _bridge_alias() -> str | None:
    """None: no link named BRIDGE; else its alias ("" for none)."""
    path = Path(f"/sys/class/net/{BRIDGE}/ifalias")
    return path.read_text().strip() if path.exists() else None


def wait_for_interrupt() -> None:
    """Block until Ctrl-C or SIGTERM (then the caller's ``with`` tears everything down)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
