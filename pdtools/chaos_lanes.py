"""Every fault of the soak, registered (importing this module imports each fault module), and
the lists derived from the registry: a lane's faults for a server, the report's request
sources.
"""

from __future__ import annotations

from pdtools import chaos_hardening, chaos_nodes, chaos_tenant, chaos_traffic
from pdtools.chaos_faults import FAULTS, LANES, faults_of

FAULT_MODULES = (chaos_nodes, chaos_traffic, chaos_hardening, chaos_tenant)  # each registers


def lanes(
    tp: int = 1, disk: bool = False, only: list[str] | None = None, tpm: bool = False
) -> dict[str, tuple[str, ...]]:
    """Each lane's faults for a server of ``tp`` ranks a node, with a disk tier or not, a
    tokens-per-minute limit a key or not (``only``: these faults alone); lanes left empty are
    left out."""
    got = {lane: faults_of(lane, tp, disk, tpm) for lane in LANES}
    if only is not None:
        got = {lane: tuple(n for n in names if n in only) for lane, names in got.items()}
    return {lane: names for lane, names in got.items() if names}


def sources() -> dict[str, str]:
    """The request sources of the faults that send requests -> how the report names them, in
    the lanes' order."""
    by_lane = sorted(FAULTS.values(), key=lambda f: LANES.index(f.lane))
    return {f.source: f.source_label for f in by_lane if f.source}
