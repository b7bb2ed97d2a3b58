"""The soak's faults: a registry of decorated functions, and ``Chaos``, which runs them in lanes
on a seeded schedule and keeps what they did.

A fault is one function ``async def f(chaos, rec, rng)`` under ``@fault(name, lane, ...)``
(``pdtools.chaos_nodes``, ``pdtools.chaos_traffic``, ``pdtools.chaos_hardening``,
``pdtools.chaos_tenant``); every
list of faults (a lane's, the soak's ``--faults`` choices, the report's request sources) is
read off ``FAULTS`` (``pdtools.chaos_lanes`` imports every fault module).

The node lane kills (SIGKILL), freezes (SIGSTOP, then SIGCONT: shorter than the heartbeat
timeout, when the node must survive, or longer, when it must be found dead and replaced) and
drains nodes (the real admin route, then ``/admin/scale`` back up), waiting between faults for
the pools to be whole again. The traffic lane floods past the admission limit, stalls readers,
trickles bodies, sends hostile input and junk frames at the nodes' sockets. A third lane runs
the hardening faults (strangers on the nodes' ports, slow readers, silent request heads, a
read-only disk tier; a planted disk chunk runs in the node lane); a fourth, the hostile tenant's
(``pdtools.chaos_tenant``), sends the requests of issue 55 with a key of its own and judges
each. Each lane runs rounds, each a seeded shuffle of its faults, until the fault phase ends.

Each fault leaves a ``FaultRecord`` (what it did and saw, and the failures it found); the nodes
it meant to kill (``doomed``) or drain (``drained``) and the windows in which it pressed on
admission explain, later, the errors requests met (``chaos_judge.judge``).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from pdtools.chaos_cluster import Api, Monitor, Pools, ProcessTree
from pdtools.chaos_load import Outcome, References, Spec

LANES = ("nodes", "traffic", "hardening", "tenant")
GAP_S = (2.0, 5.0)  # quiet seconds before each fault of a lane (drawn)
FAULT_TIMEOUT_S = 420.0  # no fault (its recovery included) may take longer
PRESSURE_GRACE_S = 10.0  # 429s this long after a flood (its queue drains) are its own


class Fault(NamedTuple):
    """One registered fault: its function and where it runs."""

    name: str
    lane: str  # one of LANES
    run: Callable[..., Awaitable[None]]  # (chaos, rec, rng)
    # "tp": nodes of several ranks (--tp N); "disk": a disk tier; "tpm": a tokens-per-minute
    # limit a key; "": nothing
    needs: str = ""
    source: str = ""  # the requests it sends are Outcomes of this source ...
    source_label: str = ""  # ... shown so in the report


FAULTS: dict[str, Fault] = {}  # name -> fault, in the order registered (a lane's order)


def fault(
    name: str, lane: str, needs: str = "", source: str = "", source_label: str = ""
) -> Callable[[Callable[..., Awaitable[None]]], Callable[..., Awaitable[None]]]:
    """Register the decorated ``async def f(chaos, rec, rng)`` as the fault ``name``."""
    assert lane in LANES and needs in ("", "tp", "disk", "tpm"), (lane, needs)

    def register(run: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
        assert name not in FAULTS, f"fault {name!r} registered twice"
        FAULTS[name] = Fault(name, lane, run, needs, source, source_label or source)
        return run

    return register


def faults_of(lane: str, tp: int = 1, disk: bool = False, tpm: bool = False) -> tuple[str, ...]:
    """The faults of ``lane`` that apply to a server of ``tp`` ranks a node, with a disk tier
    or not, a tokens-per-minute limit a key or not, in the order registered."""
    has = {"": True, "tp": tp > 1, "disk": disk, "tpm": tpm}
    return tuple(f.name for f in FAULTS.values() if f.lane == lane and has[f.needs])


@dataclass(frozen=True)
class Settings:
    """What the faults need to know of the server and how hard to push."""

    url: str
    sizes: dict[str, int]  # the pools' sizes to keep (restore after each fault)
    heartbeat_s: float  # the server's --heartbeat-timeout-s
    deadline_s: float  # a request's client-side deadline (beyond: a hang)
    max_body_bytes: int
    max_model_len: int
    admin_roles: bool  # the server tells admin keys from tenant keys
    flood_clients: int
    flood_s: float
    num_stalled: int
    stall_s: float
    num_slow: int
    slow_s: float
    junk_frames: int
    junk_big_bytes: int
    restore_timeout_s: float = 180.0
    # the faults of pdtools.chaos_hardening
    num_strangers: int = 200
    strangers_hold_s: float = 3.0
    strangers_every_port: bool = False  # also the ports the nodes do not advertise
    num_slow_readers: int = 6
    slow_read_bytes: int = 512  # read this many bytes ...
    slow_read_interval_s: float = 0.05  # ... this often
    num_silent: int = 100
    header_timeout_s: float = 10.0  # the server's --header-timeout-s
    disk_dir: Path | None = None  # the server's --disk-cache-dir
    readonly_s: float = 8.0
    num_fresh: int = 4  # fresh prompts asked twice while the disk is read-only
    # the hostile tenant's lane (pdtools.chaos_tenant)
    hostile_key: str | None = None  # its own API key (None: the steady load's)
    tokens_per_minute: int = 0  # the server's --max-tokens-per-minute-per-key (0: none)
    hostile_tokens: int = 1000  # tokens a choice of its n=16 answers
    hostile_rss_mib: float = 96.0  # the server's RSS growth allowed under its stopped readers


@dataclass
class FaultRecord:
    kind: str
    start: float
    end: float = 0.0
    target: str = ""
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    pressure: bool = False  # it pressed on admission: 429s during it are explained

    def timed(self, what: str, took: float | None, failure: str) -> None:
        """Note after how long ``what`` happened; None (not in time) is the ``failure``."""
        self.notes.append(f"{what} after {took:.1f} s" if took is not None else f"NOT {what}")
        if took is None:
            self.failures.append(failure)


class Chaos:
    """The soak's fault side: the server it acts on, the lanes that run the faults, what they
    did (``records``) and meant (``doomed``, ``drained``, the read-only windows), and the steps
    every fault shares (a victim, a signal, a wait for the pools)."""

    def __init__(
        self,
        api: Api,
        monitor: Monitor,
        tree: ProcessTree,
        settings: Settings,
        refs: References,
        long: Spec,
        outcomes: list[Outcome],
    ) -> None:
        self.api = api
        self.monitor = monitor
        self.tree = tree
        self.cfg = settings
        self.refs = refs
        self.long = long
        self.outcomes = outcomes
        self.records: list[FaultRecord] = []
        self.doomed: dict[str, float] = {}  # node -> when a fault meant it to die
        self.drained: set[str] = set()  # nodes drained on purpose
        self.extra_drained: set[str] = set()  # nodes that left with a drained one, unasked
        self.disk_lock = asyncio.Lock()  # one fault at a time harms the disk tier
        self.readonly_windows: list[tuple[float, float]] = []  # the disk tier was read-only

    # -- lanes ------------------------------------------------------------------------------

    async def lane(self, faults: tuple[str, ...], until: float, rng: random.Random) -> None:
        """Rounds of ``faults`` in a seeded order, until ``until`` (monotonic)."""
        while True:
            order = list(faults)
            rng.shuffle(order)
            for name in order:
                await asyncio.sleep(rng.uniform(*GAP_S))
                if time.monotonic() >= until:
                    return
                await self.run(name, rng)

    async def run(self, name: str, rng: random.Random) -> FaultRecord:
        """Run the fault ``name`` (bounded by ``FAULT_TIMEOUT_S``); its record."""
        if name not in FAULTS:
            raise KeyError(f"no fault {name!r} (pdtools.chaos_lanes registers them all)")
        rec = FaultRecord(name, time.monotonic())
        self.records.append(rec)
        try:
            await asyncio.wait_for(FAULTS[name].run(self, rec, rng), FAULT_TIMEOUT_S)
        except asyncio.TimeoutError:
            rec.failures.append(f"did not finish within {FAULT_TIMEOUT_S:g} s")
        except (httpx.HTTPError, OSError) as e:
            rec.failures.append(f"the soak could not carry it out: {type(e).__name__}: {e}")
        rec.end = time.monotonic()
        return rec

    # -- what the faults share ------------------------------------------------------------

    async def victim(
        self, rec: FaultRecord, rng: random.Random, role: str, busy: bool
    ) -> dict[str, Any] | None:
        """A ready node of ``role`` once the pools are whole (``busy``: one with requests on
        it, if any within 5 s). None: no such node (noted)."""
        await self.restored(rec, before=True)
        deadline = time.monotonic() + (5.0 if busy else 0.0)
        while True:
            pools = await self.monitor.poll()
            ready = pools.of(role)
            loaded = [n for n in ready if n["load"] > 0]
            if len(ready) < 2:  # never the last of a pool: that is not a fault the soak makes
                rec.notes.append(f"skipped: {len(ready)} ready {role} node(s)")
                return None
            if loaded or time.monotonic() >= deadline:
                victim = rng.choice(loaded if busy and loaded else ready)
                rec.target = victim["id"]
                return victim
            await asyncio.sleep(0.2)

    def signal(self, rec: FaultRecord, victim: dict[str, Any], sig: int) -> bool:
        """Send ``sig`` to ``victim``'s process, if it is one of the server under test (else
        noted as skipped)."""
        if self.tree.signal(victim["pid"], sig):
            return True
        rec.notes.append(
            f"skipped: pid {victim['pid']} of {victim['id']} is not a process of the server under test"
        )
        return False

    async def until(self, cond: Callable[[Pools], bool], timeout_s: float) -> float | None:
        """Seconds until ``cond(pools)`` held (polled every 0.2 s), or None after ``timeout_s``."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            try:
                if cond(await self.monitor.poll()):
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
        return None

    async def restored(self, rec: FaultRecord, before: bool = False) -> None:
        """Wait for the pools to be whole again (noted, and a failure if not in time; ``before``
        a fault: noted only if not in time)."""
        limit = self.cfg.restore_timeout_s
        took = await self.until(lambda p: p.is_whole(self.cfg.sizes), limit)
        if took is None or not before:
            rec.timed("pools whole again", took, f"pools not whole within {limit:g} s")

    def left_unasked_since(self, start: float) -> list[str]:
        """Nodes that left the pools since ``start`` that no fault meant to kill or drain."""
        return sorted(
            n
            for n, t in self.monitor.left.items()
            if t >= start and n not in self.doomed and n not in self.drained
        )

    def pressure_windows(self) -> list[tuple[float, float]]:
        return [
            (r.start, (r.end or time.monotonic()) + PRESSURE_GRACE_S)
            for r in self.records
            if r.pressure
        ]


def count_statuses(counts: Counter[int | None]) -> str:
    """``counts`` of HTTP statuses as ``n × status, ...``."""
    parts = [
        f"{n} × {s if s is not None else 'no status'}"
        for s, n in sorted(counts.items(), key=lambda kv: str(kv[0]))
    ]
    return ", ".join(parts) or "none"
