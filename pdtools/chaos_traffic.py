"""The traffic lane's faults: admission flooded past its limit, readers that stall, bodies that
trickle, hostile input, and junk frames at the nodes' sockets.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import httpx

from pdtools.chaos_faults import Chaos, FaultRecord, count_statuses, fault
from pdtools.chaos_hostile import hostile_request, hostile_requests, slow_body, stalled_reader
from pdtools.chaos_load import send
from pdtools.chaos_peers import junk_frames


@fault("flood", "traffic", source="flood")
async def flood(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    """``flood_clients`` clients, each honouring Retry-After, for ``flood_s``."""
    rec.pressure = True
    n, end = chaos.cfg.flood_clients, time.monotonic() + chaos.cfg.flood_s
    statuses: Counter[int | None] = Counter()
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=chaos.cfg.url, limits=limits) as http:

        async def client(seed: int) -> None:
            crng = random.Random(seed)
            while time.monotonic() < end:
                spec = crng.choice(chaos.refs.specs)
                out = await send(http, spec, chaos.api.headers(), chaos.cfg.deadline_s, "flood")
                chaos.outcomes.append(out)
                statuses[out.status] += 1
                if out.status == 429:
                    await asyncio.sleep(0.5 + crng.random())  # Retry-After: 1, jittered

        await asyncio.gather(*(client(rng.randrange(2**32)) for _ in range(n)))
    rec.notes.append(f"{n} clients for {chaos.cfg.flood_s:g} s: " + count_statuses(statuses))


@fault("stalled-readers", "traffic", source="stalled", source_label="stalled readers")
async def stalled_readers(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    """``num_stalled`` streams of the long answer, read not at all for ``stall_s``: the server
    must cut them (its write timeout) or finish them, never hang."""
    rec.pressure = True
    n, stall = chaos.cfg.num_stalled, chaos.cfg.stall_s
    outs = await asyncio.gather(
        *(
            stalled_reader(
                chaos.cfg.url, chaos.long, chaos.api.headers(), stall, stall + chaos.cfg.deadline_s
            )
            for _ in range(n)
        )
    )
    chaos.outcomes.extend(outs)
    whole = sum(o.complete for o in outs)
    cut = Counter(o.code or o.error.split(":")[0] or "closed" for o in outs if not o.complete)
    rec.notes.append(
        f"{n} streams of {chaos.long.body['max_tokens']} tokens reading nothing for {stall:.0f} s "
        f"(receive buffer 2 KiB): {whole} whole after it (last at "
        f"{max(o.latency for o in outs):.0f} s), {n - whole} cut"
        + (f" ({', '.join(f'{k}: {v}' for k, v in cut.items())})" if cut else "")
    )


@fault("slow-bodies", "traffic", source="slow_body", source_label="slow bodies")
async def slow_bodies(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    """``num_slow`` request bodies sent a byte at a time over ``slow_s`` (past the admission
    limit): each must get an answer or a 408. Its requests are drawn from their own seed (the
    lane's is not drawn from)."""
    rec.pressure = True
    n, slow = chaos.cfg.num_slow, chaos.cfg.slow_s
    rng = random.Random(len(chaos.records))
    specs = [rng.choice([s for s in chaos.refs.specs if not s.stream]) for _ in range(n)]
    outs = await asyncio.gather(
        *(
            slow_body(chaos.cfg.url, s, chaos.api.headers(), slow, slow + chaos.cfg.deadline_s)
            for s in specs
        )
    )
    chaos.outcomes.extend(outs)
    rec.notes.append(
        f"{n} bodies sent a byte at a time over {slow:g} s: "
        + count_statuses(Counter(o.status for o in outs))
    )


@fault("hostile-input", "traffic")
async def hostile_input(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    """Malformed, oversized and unauthorized requests: each must get its expected status."""
    cases = hostile_requests(
        chaos.cfg.max_body_bytes,
        chaos.cfg.max_model_len,
        has_keys=chaos.api.api_key is not None,
        admin_roles=chaos.cfg.admin_roles,
    )
    keys = {
        "api": chaos.api.api_key,
        "admin": chaos.api.admin_key,
        "wrong": "not-a-key",
        "none": None,
    }
    statuses: Counter[int | None] = Counter()
    for case in cases:
        resp = await hostile_request(chaos.cfg.url, case, keys)
        statuses[resp.status] += 1
        if resp.status not in case.expect:
            rec.failures.append(
                f"{case.name}: {resp.status} ({resp.error or resp.body[:120]!r}), want {case.expect}"
            )
    rec.notes.append(f"{len(cases)} malformed or refused requests: " + count_statuses(statuses))


@fault("junk-frames", "traffic")
async def junk(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    """Random frames, unsealed messages and two big frames at every ready node's request
    socket and transfer control port; then a heartbeat timeout's wait: were any of them
    found dead?"""
    pools = await chaos.monitor.poll()
    ready = [n for n in pools.nodes if n["state"] == "ready" and n["addr"]]
    endpoints = [
        (k, n[a]) for n in ready for k, a in (("push", "addr"), ("dealer", "transfer_addr"))
    ]
    if not endpoints:
        rec.notes.append("skipped: /admin/nodes gives no socket addresses")
        return
    before = await chaos.api.metrics()
    start = time.monotonic()
    num_sent = await asyncio.to_thread(
        junk_frames,
        endpoints,
        chaos.cfg.junk_frames,
        chaos.cfg.junk_big_bytes,
        rng.randrange(2**32),
    )
    took = time.monotonic() - start
    await asyncio.sleep(chaos.cfg.heartbeat_s + 1)
    after = await chaos.api.metrics()
    rejected = after.total("pd_node_rejected_messages") - before.total("pd_node_rejected_messages")
    dropped = after.total("pd_node_dropped_messages") - before.total("pd_node_dropped_messages")
    gone = chaos.left_unasked_since(start)
    rec.target = f"{len(ready)} nodes"
    rec.notes.append(
        f"{num_sent} frames ({chaos.cfg.junk_frames} random or unsealed + 2 of "
        f"{chaos.cfg.junk_big_bytes >> 20} MiB per socket, {len(endpoints)} sockets) in {took:.1f} s: "
        f"{rejected:.0f} refused at the seal, {dropped:.0f} dropped; "
        + (f"found dead meanwhile: {gone}" if gone else "no node found dead")
    )
    if gone:
        rec.failures.append(f"healthy nodes found dead during the junk frames: {gone}")
