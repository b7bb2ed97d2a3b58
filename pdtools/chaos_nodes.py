"""The node lane's faults: nodes killed (SIGKILL), frozen (SIGSTOP, then SIGCONT: shorter than
the heartbeat timeout, when the node must survive, or longer, when it must be found dead and
replaced) and drained (the real admin route, then ``/admin/scale`` back up), each waiting for the
pools to be whole again; on nodes of several ranks (``chaos_soak.py --tp N``), one rank of a
node killed or frozen alone.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time

from pdtools.chaos_cluster import ROLES, Pools, child_pids
from pdtools.chaos_faults import Chaos, FaultRecord, fault


@fault("kill-prefill", "nodes")
async def kill_prefill(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    await kill(chaos, rec, rng, "prefill")


@fault("kill-decode", "nodes")
async def kill_decode(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    await kill(chaos, rec, rng, "decode")


@fault("freeze-short", "nodes")
async def freeze_short(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    await freeze(chaos, rec, rng, is_long=False)


@fault("freeze-long", "nodes")
async def freeze_long(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    await freeze(chaos, rec, rng, is_long=True)


# -- nodes ------------------------------------------------------------------------------


async def kill(chaos: Chaos, rec: FaultRecord, rng: random.Random, role: str) -> None:
    """SIGKILL a node of ``role`` (one with requests on it, if any): it must be found dead
    and replaced."""
    if (victim := await chaos.victim(rec, rng, role, busy=True)) is None:
        return
    if not chaos.signal(rec, victim, signal.SIGKILL):
        return
    node_id, limit = victim["id"], chaos.cfg.heartbeat_s + 10
    chaos.doomed[node_id] = time.monotonic()
    rec.notes.append(f"SIGKILL {node_id} (pid {victim['pid']}, {victim['load']} requests on it)")
    found = await chaos.until(lambda p: node_id not in p.ids, limit)
    rec.timed("found dead", found, f"{node_id} killed, still listed after {limit:g} s")
    await chaos.restored(rec)


async def freeze(chaos: Chaos, rec: FaultRecord, rng: random.Random, is_long: bool) -> None:
    """SIGSTOP a node, SIGCONT it later. Shorter than the heartbeat timeout (0.4 of it): it
    must stay; longer: it must be found dead within the timeout (+2 s) and replaced."""
    role = rng.choice(ROLES)
    if (victim := await chaos.victim(rec, rng, role, busy=False)) is None:
        return
    hb = chaos.cfg.heartbeat_s
    if not chaos.signal(rec, victim, signal.SIGSTOP):
        return
    node_id = victim["id"]
    try:
        if is_long:  # found dead within the timeout (and a beat), replaced
            chaos.doomed[node_id] = time.monotonic()
            found = await chaos.until(lambda p: node_id not in p.ids, hb + 2)
        else:
            await asyncio.sleep(0.4 * hb)
    finally:
        chaos.tree.signal(victim["pid"], signal.SIGCONT)  # if it is still there
    if is_long:
        rec.notes.append(f"SIGSTOP {node_id} (heartbeat timeout {hb:g} s)")
        rec.timed("found dead", found, f"frozen {node_id} not found dead within {hb + 2:g} s")
        await chaos.restored(rec)
        return
    await asyncio.sleep(hb + 1)  # past the timeout from the freeze: was it kept?
    pools = await chaos.monitor.poll()
    kept = any(n["id"] == node_id and n["state"] == "ready" for n in pools.nodes)
    rec.notes.append(
        f"SIGSTOP {node_id} for {0.4 * hb:.1f} s, then SIGCONT (heartbeat timeout {hb:g} s): "
        + ("kept" if kept else "declared dead")
    )
    if not kept:
        rec.failures.append(f"{node_id} declared dead after a {0.4 * hb:.1f} s freeze")
        await chaos.restored(rec)


@fault("drain", "nodes")
async def drain(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    """Drain one node through ``POST /admin/nodes/{id}/drain``: exactly it must leave; then
    ``POST /admin/scale`` back to the pool's size."""
    role = rng.choice(ROLES)
    if (victim := await chaos.victim(rec, rng, role, busy=False)) is None:
        return
    node_id = victim["id"]
    others = (
        {n["id"] for n in chaos.monitor.pools.of(role)} - {node_id}
        if chaos.monitor.pools
        else set()
    )
    r = await chaos.api.drain(node_id)
    chaos.drained.add(node_id)
    rec.notes.append(f"POST /admin/nodes/{node_id}/drain: {r.status_code}")
    if r.status_code != 202:
        rec.failures.append(f"POST /admin/nodes/{node_id}/drain: {r.status_code} {r.text[:200]}")
        return
    touched: set[str] = set()

    def left(p: Pools) -> bool:
        now = {n["id"]: n["state"] for n in p.nodes}
        touched.update(o for o in others if now.get(o, "gone") != "ready")
        return node_id not in now

    limit = chaos.cfg.deadline_s + 30
    took = await chaos.until(left, limit)
    rec.timed(f"{node_id} left", took, f"drained {node_id} still there after {limit:g} s")
    if touched:
        chaos.extra_drained |= touched
        rec.failures.append(f"draining {node_id} also took {sorted(touched)} off the {role} pool")
    r = await chaos.api.scale(**{role: chaos.cfg.sizes[role]})
    if r.status_code != 202:
        rec.failures.append(f"POST /admin/scale: {r.status_code} {r.text[:200]}")
    await chaos.restored(rec)


@fault("kill-rank", "nodes", needs="tp")
async def kill_rank(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    """SIGKILL one rank >= 1 of a node of several (a busy one, if any): the node must go
    down as one, be found dead and be replaced."""
    await _rank_fault(chaos, rec, rng, signal.SIGKILL, "SIGKILL")


@fault("freeze-rank", "nodes", needs="tp")
async def freeze_rank(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    """SIGSTOP one rank >= 1 of a node of several, for good: its node stops in a sum and
    misses its heartbeats; it must be found dead within the timeout (+2 s) and replaced (the
    kernel kills the frozen rank with its node)."""
    await _rank_fault(chaos, rec, rng, signal.SIGSTOP, "SIGSTOP")


async def _rank_fault(
    chaos: Chaos, rec: FaultRecord, rng: random.Random, sig: int, name: str
) -> None:
    role = rng.choice(ROLES)
    if (victim := await chaos.victim(rec, rng, role, busy=True)) is None:
        return
    ranks = [p for p in child_pids(victim["pid"]) if chaos.tree.owns(p)]
    if not ranks:
        rec.notes.append(f"skipped: {victim['id']} has no rank processes (TP 1?)")
        return
    rank_pid = rng.choice(ranks)
    node_id, limit = victim["id"], chaos.cfg.heartbeat_s + 10
    chaos.doomed[node_id] = time.monotonic()
    if not chaos.tree.signal(rank_pid, sig):
        rec.notes.append(f"skipped: rank pid {rank_pid} is gone")
        return
    rec.notes.append(
        f"{name} a rank (pid {rank_pid}) of {node_id} ({victim['load']} requests on it)"
    )
    found = await chaos.until(lambda p: node_id not in p.ids, limit)
    rec.timed("found dead", found, f"{node_id}'s rank {name}, still listed after {limit:g} s")
    await chaos.restored(rec)
