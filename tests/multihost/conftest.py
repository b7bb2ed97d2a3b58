"""Hosts in network namespaces (``pdtools/netns_hosts.py``) that run Ray and pd for real.

The set needs root (namespaces, a bridge, an sshd per host). As root it installs what the
harness lacks (``apt-get install openssh-server rsync``); elsewhere, or where network
namespaces cannot be made, every test skips saying why. What the tests measured (times, the
addresses on the KV sockets) is printed at the end of the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from pdtools.netns_hosts import HarnessBusy, NetnsHosts, install_tools, missing_tools
from tests.conftest import MULTIHOST_SECTION

REPORT: list[str] = []  # lines for the terminal summary
_num_reported = 0  # REPORT's lines already on a test's report


def _why_not() -> str | None:
    """None when the harness can run here, else the reason to skip."""
    if not sys.platform.startswith("linux"):
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (network namespaces, a bridge, an sshd per host)"
    if missing_tools():
        try:
            install_tools()
        except (OSError, subprocess.SubprocessError) as e:
            return f"apt-get install openssh-server rsync failed: {e}"
        if missing := missing_tools():
            return f"still missing after apt-get: {', '.join(missing)}"
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot make a network namespace here: {probe.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def netns_hosts(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NetnsHosts]:
    """The harness, started with no host yet; everything it made is gone afterwards (after a
    failure, its logs and the hosts' Ray logs are kept in a pytest temp dir first)."""
    if why := _why_not():
        pytest.skip(why)
    hosts = NetnsHosts()
    failed = request.session.testsfailed
    try:
        hosts.start(0)
        yield hosts
    except HarnessBusy as e:
        pytest.skip(str(e))
    finally:
        if request.session.testsfailed > failed:
            dest = tmp_path_factory.mktemp("netns-logs")
            hosts.save_logs(dest)
            REPORT.append(f"logs of the failed run: {dest}")
        hosts.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Iterator[None]:
    """REPORT's new lines ride on the test's report (``user_properties``): the run's summary
    is written where the reports arrive, which under pytest-xdist is not this process
    (``tests/conftest.py``'s ``pytest_terminal_summary``)."""
    global _num_reported
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    report.user_properties.extend((MULTIHOST_SECTION, line) for line in REPORT[_num_reported:])
    _num_reported = len(REPORT)
