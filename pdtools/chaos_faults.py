"""The soak's faults, each a small method of ``Chaos``, run in two lanes on a seeded schedule.

The node lane kills (SIGKILL), freezes (SIGSTOP, then SIGCONT: shorter than the heartbeat
timeout, when the node must survive, or longer, when it must be found dead and replaced) and
drains nodes (the real admin route, then ``/admin/scale`` back up), waiting between faults for
the pools to be whole again. The traffic lane floods past the admission limit, stalls readers,
trickles bodies, sends hostile input and junk frames at the nodes' sockets. A third lane runs
the faults of ``pdtools.chaos_hardening`` (strangers on the nodes' ports, slow readers, silent
request heads, a read-only disk tier; a planted disk chunk runs in the node lane). Each lane
runs rounds, each a seeded shuffle of its faults, until the fault phase ends.

Each fault leaves a ``FaultRecord`` (what it did and saw, and the failures it found); the nodes
it meant to kill (``doomed``) or drain (``drained``) and the windows in which it pressed on
admission explain, later, the errors requests met (``chaos_report.judge``).
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdtools import chaos_hardening
from pdtools.chaos_cluster import ROLES, Api, Monitor, Pools, ProcessTree, child_pids
from pdtools.chaos_hostile import (
    hostile_request,
    hostile_requests,
    junk_frames,
    slow_body,
    stalled_reader,
)
from pdtools.chaos_load import Outcome, References, Spec, send

NODE_FAULTS = ("kill-prefill", "kill-decode", "freeze-short", "freeze-long", "drain")
# nodes of several ranks (``chaos_soak.py --tp N``): one rank of a node killed, or frozen
RANK_FAULTS = ("kill-rank", "freeze-rank")
TRAFFIC_FAULTS = ("flood", "stalled-readers", "slow-bodies", "hostile-input", "junk-frames")
GAP_S = (2.0, 5.0)  # quiet seconds before each fault of a lane (drawn)
FAULT_TIMEOUT_S = 420.0  # no fault (its recovery included) may take longer
PRESSURE_GRACE_S = 10.0  # 429s this long after a flood (its queue drains) are its own


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
        kind, _, arg = name.partition("-")
        rec = FaultRecord(name, time.monotonic())
        self.records.append(rec)
        if name in chaos_hardening.FAULTS:
            kind = name  # the hardening faults' names are not of kind-arg
        fault: Callable[..., Any] = {
            **{
                n: (lambda f=f: f(self, rec, rng))  # type: ignore[misc]
                for n, f in chaos_hardening.FAULTS.items()
            },
            "kill": lambda: self.kill_rank(rec, rng) if arg == "rank" else self.kill(rec, rng, arg),
            "freeze": lambda: (
                self.freeze_rank(rec, rng)
                if arg == "rank"
                else self.freeze(rec, rng, arg == "long")
            ),
            "drain": lambda: self.drain(rec, rng),
            "flood": lambda: self.flood(rec, rng),
            "stalled": lambda: self.stalled_readers(rec),
            "slow": lambda: self.slow_bodies(rec),
            "hostile": lambda: self.hostile_input(rec),
            "junk": lambda: self.junk(rec, rng),
        }[kind]
        try:
            await asyncio.wait_for(fault(), FAULT_TIMEOUT_S)
        except asyncio.TimeoutError:
            rec.failures.append(f"did not finish within {FAULT_TIMEOUT_S:g} s")
        except (httpx.HTTPError, OSError) as e:
            rec.failures.append(f"the soak could not carry it out: {type(e).__name__}: {e}")
        rec.end = time.monotonic()
        return rec

    # -- nodes ------------------------------------------------------------------------------

    async def kill(self, rec: FaultRecord, rng: random.Random, role: str) -> None:
        """SIGKILL a node of ``role`` (one with requests on it, if any): it must be found dead
        and replaced."""
        if (victim := await self._victim(rec, rng, role, busy=True)) is None:
            return
        if not self._signal(rec, victim, signal.SIGKILL):
            return
        node_id, limit = victim["id"], self.cfg.heartbeat_s + 10
        self.doomed[node_id] = time.monotonic()
        rec.notes.append(
            f"SIGKILL {node_id} (pid {victim['pid']}, {victim['load']} requests on it)"
        )
        found = await self._until(lambda p: node_id not in p.ids, limit)
        rec.timed("found dead", found, f"{node_id} killed, still listed after {limit:g} s")
        await self._restored(rec)

    async def freeze(self, rec: FaultRecord, rng: random.Random, is_long: bool) -> None:
        """SIGSTOP a node, SIGCONT it later. Shorter than the heartbeat timeout (0.4 of it): it
        must stay; longer: it must be found dead within the timeout (+2 s) and replaced."""
        role = rng.choice(ROLES)
        if (victim := await self._victim(rec, rng, role, busy=False)) is None:
            return
        hb = self.cfg.heartbeat_s
        if not self._signal(rec, victim, signal.SIGSTOP):
            return
        node_id = victim["id"]
        try:
            if is_long:  # found dead within the timeout (and a beat), replaced
                self.doomed[node_id] = time.monotonic()
                found = await self._until(lambda p: node_id not in p.ids, hb + 2)
            else:
                await asyncio.sleep(0.4 * hb)
        finally:
            self.tree.signal(victim["pid"], signal.SIGCONT)  # if it is still there
        if is_long:
            rec.notes.append(f"SIGSTOP {node_id} (heartbeat timeout {hb:g} s)")
            rec.timed("found dead", found, f"frozen {node_id} not found dead within {hb + 2:g} s")
            await self._restored(rec)
            return
        await asyncio.sleep(hb + 1)  # past the timeout from the freeze: was it kept?
        pools = await self.monitor.poll()
        kept = any(n["id"] == node_id and n["state"] == "ready" for n in pools.nodes)
        rec.notes.append(
            f"SIGSTOP {node_id} for {0.4 * hb:.1f} s, then SIGCONT (heartbeat timeout {hb:g} s): "
            + ("kept" if kept else "declared dead")
        )
        if not kept:
            rec.failures.append(f"{node_id} declared dead after a {0.4 * hb:.1f} s freeze")
            await self._restored(rec)

    async def kill_rank(self, rec: FaultRecord, rng: random.Random) -> None:
        """SIGKILL one rank >= 1 of a node of several (a busy one, if any): the node must go
        down as one, be found dead and be replaced."""
        await self._rank_fault(rec, rng, signal.SIGKILL, "SIGKILL")

    async def freeze_rank(self, rec: FaultRecord, rng: random.Random) -> None:
        """SIGSTOP one rank >= 1 of a node of several, for good: its node stops in a sum and
        misses its heartbeats; it must be found dead within the timeout (+2 s) and replaced (the
        kernel kills the frozen rank with its node)."""
        await self._rank_fault(rec, rng, signal.SIGSTOP, "SIGSTOP")

    async def _rank_fault(self, rec: FaultRecord, rng: random.Random, sig: int, name: str) -> None:
        role = rng.choice(ROLES)
        if (victim := await self._victim(rec, rng, role, busy=True)) is None:
            return
        ranks = [p for p in child_pids(victim["pid"]) if self.tree.owns(p)]
        if not ranks:
            rec.notes.append(f"skipped: {victim['id']} has no rank processes (TP 1?)")
            return
        rank_pid = rng.choice(ranks)
        node_id, limit = victim["id"], self.cfg.heartbeat_s + 10
        self.doomed[node_id] = time.monotonic()
        if not self.tree.signal(rank_pid, sig):
            rec.notes.append(f"skipped: rank pid {rank_pid} is gone")
            return
        rec.notes.append(
            f"{name} a rank (pid {rank_pid}) of {node_id} ({victim['load']} requests on it)"
        )
        found = await self._until(lambda p: node_id not in p.ids, limit)
        rec.timed("found dead", found, f"{node_id}'s rank {name}, still listed after {limit:g} s")
        await self._restored(rec)

    async def drain(self, rec: FaultRecord, rng: random.Random) -> None:
        """Drain one node through ``POST /admin/nodes/{id}/drain``: exactly it must leave; then
        ``POST /admin/scale`` back to the pool's size."""
        role = rng.choice(ROLES)
        if (victim := await self._victim(rec, rng, role, busy=False)) is None:
            return
        node_id = victim["id"]
        others = (
            {n["id"] for n in self.monitor.pools.of(role)} - {node_id}
            if self.monitor.pools
            else set()
        )
        r = await self.api.drain(node_id)
        self.drained.add(node_id)
        rec.notes.append(f"POST /admin/nodes/{node_id}/drain: {r.status_code}")
        if r.status_code != 202:
            rec.failures.append(
                f"POST /admin/nodes/{node_id}/drain: {r.status_code} {r.text[:200]}"
            )
            return
        touched: set[str] = set()

        def left(p: Pools) -> bool:
            now = {n["id"]: n["state"] for n in p.nodes}
            touched.update(o for o in others if now.get(o, "gone") != "ready")
            return node_id not in now

        limit = self.cfg.deadline_s + 30
        took = await self._until(left, limit)
        rec.timed(f"{node_id} left", took, f"drained {node_id} still there after {limit:g} s")
        if touched:
            self.extra_drained |= touched
            rec.failures.append(
                f"draining {node_id} also took {sorted(touched)} off the {role} pool"
            )
        r = await self.api.scale(**{role: self.cfg.sizes[role]})
        if r.status_code != 202:
            rec.failures.append(f"POST /admin/scale: {r.status_code} {r.text[:200]}")
        await self._restored(rec)

    async def _victim(
        self, rec: FaultRecord, rng: random.Random, role: str, busy: bool
    ) -> dict[str, Any] | None:
        """A ready node of ``role`` once the pools are whole (``busy``: one with requests on
        it, if any within 5 s). None: no such node (noted)."""
        await self._restored(rec, before=True)
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

    def _signal(self, rec: FaultRecord, victim: dict[str, Any], sig: int) -> bool:
        if self.tree.signal(victim["pid"], sig):
            return True
        rec.notes.append(
            f"skipped: pid {victim['pid']} of {victim['id']} is not a process of the server under test"
        )
        return False

    async def _until(self, cond: Callable[[Pools], bool], timeout_s: float) -> float | None:
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

    async def _restored(self, rec: FaultRecord, before: bool = False) -> None:
        limit = self.cfg.restore_timeout_s
        took = await self._until(lambda p: p.is_whole(self.cfg.sizes), limit)
        if took is None or not before:
            rec.timed("pools whole again", took, f"pools not whole within {limit:g} s")

    # -- traffic ----------------------------------------------------------------------------

    async def flood(self, rec: FaultRecord, rng: random.Random) -> None:
        """``flood_clients`` clients, each honouring Retry-After, for ``flood_s``."""
        rec.pressure = True
        n, end = self.cfg.flood_clients, time.monotonic() + self.cfg.flood_s
        statuses: Counter[int | None] = Counter()
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=self.cfg.url, limits=limits) as http:

            async def client(seed: int) -> None:
                crng = random.Random(seed)
                while time.monotonic() < end:
                    spec = crng.choice(self.refs.specs)
                    out = await send(http, spec, self.api.headers(), self.cfg.deadline_s, "flood")
                    self.outcomes.append(out)
                    statuses[out.status] += 1
                    if out.status == 429:
                        await asyncio.sleep(0.5 + crng.random())  # Retry-After: 1, jittered

            await asyncio.gather(*(client(rng.randrange(2**32)) for _ in range(n)))
        rec.notes.append(f"{n} clients for {self.cfg.flood_s:g} s: " + _statuses(statuses))

    async def stalled_readers(self, rec: FaultRecord) -> None:
        rec.pressure = True
        n, stall = self.cfg.num_stalled, self.cfg.stall_s
        outs = await asyncio.gather(
            *(
                stalled_reader(
                    self.cfg.url, self.long, self.api.headers(), stall, stall + self.cfg.deadline_s
                )
                for _ in range(n)
            )
        )
        self.outcomes.extend(outs)
        whole = sum(o.complete for o in outs)
        cut = Counter(o.code or o.error.split(":")[0] or "closed" for o in outs if not o.complete)
        rec.notes.append(
            f"{n} streams of {self.long.body['max_tokens']} tokens reading nothing for {stall:.0f} s "
            f"(receive buffer 2 KiB): {whole} whole after it (last at "
            f"{max(o.latency for o in outs):.0f} s), {n - whole} cut"
            + (f" ({', '.join(f'{k}: {v}' for k, v in cut.items())})" if cut else "")
        )

    async def slow_bodies(self, rec: FaultRecord) -> None:
        rec.pressure = True
        n, slow = self.cfg.num_slow, self.cfg.slow_s
        rng = random.Random(len(self.records))
        specs = [rng.choice([s for s in self.refs.specs if not s.stream]) for _ in range(n)]
        outs = await asyncio.gather(
            *(
                slow_body(self.cfg.url, s, self.api.headers(), slow, slow + self.cfg.deadline_s)
                for s in specs
            )
        )
        self.outcomes.extend(outs)
        rec.notes.append(
            f"{n} bodies sent a byte at a time over {slow:g} s: "
            + _statuses(Counter(o.status for o in outs))
        )

    async def hostile_input(self, rec: FaultRecord) -> None:
        cases = hostile_requests(
            self.cfg.max_body_bytes,
            self.cfg.max_model_len,
            has_keys=self.api.api_key is not None,
            admin_roles=self.cfg.admin_roles,
        )
        keys = {
            "api": self.api.api_key,
            "admin": self.api.admin_key,
            "wrong": "not-a-key",
            "none": None,
        }
        statuses: Counter[int | None] = Counter()
        for case in cases:
            resp = await hostile_request(self.cfg.url, case, keys)
            statuses[resp.status] += 1
            if resp.status not in case.expect:
                rec.failures.append(
                    f"{case.name}: {resp.status} ({resp.error or resp.body[:120]!r}), want {case.expect}"
                )
        rec.notes.append(f"{len(cases)} malformed or refused requests: " + _statuses(statuses))

    async def junk(self, rec: FaultRecord, rng: random.Random) -> None:
        """Random frames, unsealed messages and two big frames at every ready node's request
        socket and transfer control port; then a heartbeat timeout's wait: were any of them
        found dead?"""
        pools = await self.monitor.poll()
        ready = [n for n in pools.nodes if n["state"] == "ready" and n["addr"]]
        endpoints = [
            (k, n[a]) for n in ready for k, a in (("push", "addr"), ("dealer", "transfer_addr"))
        ]
        if not endpoints:
            rec.notes.append("skipped: /admin/nodes gives no socket addresses")
            return
        before = await self.api.metrics()
        start = time.monotonic()
        num_sent = await asyncio.to_thread(
            junk_frames,
            endpoints,
            self.cfg.junk_frames,
            self.cfg.junk_big_bytes,
            rng.randrange(2**32),
        )
        took = time.monotonic() - start
        await asyncio.sleep(self.cfg.heartbeat_s + 1)
        after = await self.api.metrics()
        rejected = after.total("pd_node_rejected_messages") - before.total(
            "pd_node_rejected_messages"
        )
        dropped = after.total("pd_node_dropped_messages") - before.total("pd_node_dropped_messages")
        gone = self.left_unasked_since(start)
        rec.target = f"{len(ready)} nodes"
        rec.notes.append(
            f"{num_sent} frames ({self.cfg.junk_frames} random or unsealed + 2 of "
            f"{self.cfg.junk_big_bytes >> 20} MiB per socket, {len(endpoints)} sockets) in {took:.1f} s: "
            f"{rejected:.0f} refused at the seal, {dropped:.0f} dropped; "
            + (f"found dead meanwhile: {gone}" if gone else "no node found dead")
        )
        if gone:
            rec.failures.append(f"healthy nodes found dead during the junk frames: {gone}")

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


def _statuses(counts: Counter[int | None]) -> str:
    parts = [
        f"{n} × {s if s is not None else 'no status'}"
        for s, n in sorted(counts.items(), key=lambda kv: str(kv[0]))
    ]
    return ", ".join(parts) or "none"
