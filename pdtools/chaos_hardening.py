"""The hardening lane's faults: hostile peers and a harmed disk tier (``planted-chunk`` runs
in the node lane, and only with a disk tier):

- ``strangers``: many TCP connections to the ports the nodes advertise (their inboxes and
  transfer control ports; with ``strangers_every_port``, every port their processes listen
  on), some sending junk, held a few seconds and closed: no node may be found dead, and none
  may hold one of them 10 s after its client closed it;
- ``slow-readers``: long streams read a few hundred bytes at a time, slowly but never stalled:
  each must be whole and the reference answer;
- ``silent-headers``: connections that send half a request head and go quiet: the server must
  close each at its header deadline (measured), its descriptors must come back;
- ``readonly-disk``: the disk tier's model directories made read-only (``chattr +i`` as root)
  while fresh prompts are asked twice (the reuse writes their chunks through): the nodes that
  write must turn their tier off (``pd_node_disk_tier_off``) and serve on, every answer the one
  asked before; then the directory is made writable again (a node started later writes there);
- ``planted-chunk`` (a node fault: it ends in a kill): the newest chunk replaced by a forgery of
  the same name, header and payload checksum under another key, then a node killed: its
  replacement, which reads the directory's newest chunks as it starts, must refuse and remove
  it, and no answer may change.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from pdtools.chaos_cluster import ROLES, held_from, listening_ports
from pdtools.chaos_faults import Chaos, FaultRecord, fault
from pdtools.chaos_hostile import silent_head, slow_reader
from pdtools.chaos_load import Outcome, Spec, send
from pdtools.chaos_nodes import kill
from pdtools.chaos_peers import hold_strangers
from pdtools.disk_faults import CannotHarm, make_read_only, plant_over

CLOSE_MARGIN_S = 5.0  # past the header deadline, for the server to close (2 shared cores)
READONLY_GRACE_S = 15.0  # after a read-only window: for a reused node's tier-off or write to show
WORDS = (
    "river bridge market clock wool salt railway factory museum library school music square "
    "harbour tower garden mill canal chapel orchard meadow lantern ferry station"
).split()


@fault("strangers", "hardening")
async def strangers(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    cfg = chaos.cfg
    pools = await chaos.monitor.poll()
    ready = [n for n in pools.nodes if n["state"] == "ready" and chaos.tree.owns(n["pid"])]
    ports = {  # the sockets the nodes advertise: inbox, transfer control
        n["id"]: [urlsplit(n[a]).port for a in ("addr", "transfer_addr") if n[a]]
        for n in pools.nodes
        if n["state"] == "ready"
    }
    if cfg.strangers_every_port:  # and every other port their processes listen on
        for n in ready:
            ports[n["id"]] = sorted({*ports[n["id"]], *listening_ports(n["pid"])})
    every = sorted({p for ps in ports.values() for p in ps if p})
    if not every:
        rec.notes.append("skipped: no node port known")
        return
    start = time.monotonic()
    mine, num_junk, refused = await asyncio.to_thread(
        hold_strangers, every, cfg.num_strangers, cfg.strangers_hold_s, rng.randrange(2**32)
    )
    rec.target = f"{len(ports)} nodes, {len(every)} ports"
    rec.notes.append(
        f"{len(mine)} connections ({num_junk} sending junk, {refused} refused) to {len(every)} "
        f"ports held {cfg.strangers_hold_s:g} s"
    )
    names = {
        urlsplit(n[a]).port: f"{n['id']} {a}"
        for n in pools.nodes
        for a in ("addr", "transfer_addr")
        if n[a]
    }
    nodes = {n["id"]: n["pid"] for n in ready}
    await _closed_by(rec, nodes, mine, "node", names=names, closed=True)
    await asyncio.sleep(max(0.0, cfg.heartbeat_s + 1 - (time.monotonic() - start)))
    gone = chaos.left_unasked_since(start)
    rec.notes.append(f"found dead meanwhile: {gone}" if gone else "no node found dead")
    if gone:
        rec.failures.append(f"healthy nodes found dead during the strangers: {gone}")


async def _closed_by(
    rec: FaultRecord,
    pids: dict[str, int],
    ports: set[int],
    what: str,
    timeout_s: float = 10.0,
    names: dict[int, str] | None = None,
    closed: bool = False,
) -> None:
    """Wait until no process of ``pids`` holds a connection from ``ports`` (each must close
    its side within ``timeout_s``). ``names``: what a port is; ``closed``: the clients closed
    theirs (``held_from``)."""
    if not pids:
        return
    start = time.monotonic()
    while True:
        held = {i: h for i, pid in pids.items() if (h := held_from(pid, ports, closed))}
        if not held or time.monotonic() - start > timeout_s:
            break
        await asyncio.sleep(0.25)
    if held:
        names = names or {}
        rec.failures.append(
            f"{what}s still hold connections {timeout_s:g} s after their clients closed them: "
            + "; ".join(
                f"{i}: "
                + ", ".join(
                    f"{n} on port {port} ({names.get(port, 'unadvertised')}, {state})"
                    for (port, state), n in sorted(h.items())
                )
                for i, h in held.items()
            )
        )
    else:
        rec.notes.append(f"every {what} closed its side within {time.monotonic() - start:.1f} s")


@fault("slow-readers", "hardening", source="slow_reader", source_label="slow readers")
async def slow_readers(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    """Streams of the long answer (past the socket buffers and uvicorn's 64 KiB), each read
    ``slow_read_bytes`` every ``slow_read_interval_s``: uvicorn's buffer drains slower than the
    write timeout, yet the client takes bytes all along."""
    cfg = chaos.cfg
    outs = await asyncio.gather(
        *(
            slow_reader(
                cfg.url,
                chaos.long,
                chaos.api.headers(),
                cfg.slow_read_bytes,
                cfg.slow_read_interval_s,
                cfg.deadline_s,
            )  # fmt: skip
            for _ in range(cfg.num_slow_readers)
        )
    )
    chaos.outcomes.extend(outs)
    whole = [o for o in outs if o.complete]
    rate = cfg.slow_read_bytes / cfg.slow_read_interval_s / 1024
    rec.notes.append(
        f"{len(outs)} streams of {chaos.long.body['max_tokens']} tokens read "
        f"{cfg.slow_read_bytes} bytes every {cfg.slow_read_interval_s:g} s ({rate:.1f} KiB/s; "
        f"the write timeout cut a reader this slow before): {len(whole)} whole, longest "
        f"{max(o.latency for o in outs):.1f} s"
    )


@fault("silent-headers", "hardening")
async def silent_headers(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    """Half a head on each of ``num_silent`` connections; each must be closed at the server's
    header deadline (+ ``CLOSE_MARGIN_S``)."""
    cfg = chaos.cfg
    host = urlsplit(cfg.url).netloc
    partial = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n".encode()
    server = chaos.tree.root
    pids = {"server": server} if server is not None else {}
    limit = cfg.header_timeout_s + CLOSE_MARGIN_S
    got = await asyncio.gather(
        *(silent_head(cfg.url, partial, limit) for _ in range(cfg.num_silent)),
        return_exceptions=True,
    )
    closed = [g[0] for g in got if isinstance(g, tuple) and g[0] is not None]
    num_408 = sum(1 for g in got if isinstance(g, tuple) and g[1].startswith(b"HTTP/1.1 408"))
    errors = [g for g in got if isinstance(g, BaseException)]
    rec.notes.append(
        f"{cfg.num_silent} connections sent half a head and went quiet (header deadline "
        f"{cfg.header_timeout_s:g} s): {len(closed)} closed ({num_408} with a 408)"
        + (
            f" after {min(closed):.1f} / {statistics.median(closed):.1f} / {max(closed):.1f} s"
            " (first / median / last)"
            if closed
            else ""
        )
        + (f"; {len(errors)} could not connect: {errors[0]!r}" if errors else "")
    )
    if len(closed) + len(errors) < cfg.num_silent:
        rec.failures.append(
            f"{cfg.num_silent - len(closed) - len(errors)} silent connections still open "
            f"{limit:g} s after they connected"
        )
    ports = {g[2] for g in got if isinstance(g, tuple)}  # each closed by the server, then here
    await _closed_by(rec, pids, ports, "server", 5.0, closed=True)


def _fresh_spec(rng: random.Random, tag: str) -> Spec:
    """A completion over a prompt no request asked before (its chunks are not on disk)."""
    words = " ".join(rng.choice(WORDS) for _ in range(150))
    body = {  # its own first tokens: no node holds a prefix of it, so any may be routed to
        "prompt": f"Notes {tag}, {rng.randrange(10**9)}: {words}\n\nQ: Which word came first?\nA:",
        "max_tokens": 8,
        "temperature": 0,
    }
    return Spec(f"disk-{tag}", "completions", body, False)


async def _reference(chaos: Chaos, http: httpx.AsyncClient, spec: Spec) -> bool:
    """Ask ``spec`` once (up to 3 tries) and keep its answer as its reference."""
    for _ in range(3):
        out = await send(http, spec, chaos.api.headers(), chaos.cfg.deadline_s, "reference")
        if out.status == 200 and out.complete and out.answer is not None:
            chaos.refs.answers[spec.name] = out.answer
            return True
        await asyncio.sleep(1.0)
    return False


@fault(
    "readonly-disk", "hardening", source="disk", source_label="fresh prompts, disk tier read-only"
)
async def readonly_disk(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    cfg = chaos.cfg
    if cfg.disk_dir is None or not (
        dirs := sorted(p for p in cfg.disk_dir.iterdir() if p.is_dir())
    ):
        rec.notes.append("skipped: no disk tier directory")
        return
    limits = httpx.Limits(max_keepalive_connections=0)
    async with chaos.disk_lock, httpx.AsyncClient(base_url=cfg.url, limits=limits) as http:
        specs = [_fresh_spec(rng, f"{len(chaos.records)}-{i}") for i in range(cfg.num_fresh)]
        asked = await _asked(chaos, http, specs)
        before = await chaos.api.metrics()
        off0 = {n for n, v in before.by("pd_node_disk_tier_off", "node").items() if v}
        undos = []
        start = time.monotonic()
        try:
            for d in dirs:
                undos.append(await asyncio.to_thread(make_read_only, d))
        except CannotHarm as e:
            rec.notes.append(f"skipped: {e}")
            return
        finally:
            if len(undos) < len(dirs):
                for undo in undos:
                    await asyncio.to_thread(undo)
        try:
            rec.target = ", ".join(d.name for d in dirs)
            outs = await asyncio.gather(*(_twice(chaos, http, s) for s in asked))
            newly_off: dict[str, float] = {}
            while time.monotonic() - start < cfg.readonly_s:
                metrics = await chaos.api.metrics()
                for n, v in metrics.by("pd_node_disk_tier_off", "node").items():
                    if v and n not in off0:
                        newly_off.setdefault(n, time.monotonic() - start)
                await asyncio.sleep(0.5)
        finally:
            for undo in undos:
                await asyncio.to_thread(undo)
            chaos.readonly_windows.append((start, time.monotonic()))
    flat = [o for pair in outs for o in pair]
    chaos.outcomes.extend(flat)
    # the nodes that reused a fresh prefix (and so wrote its chunks) while it was read-only
    reused_on = set()
    for out in flat:
        if out.cached_tokens and out.request_id:
            for attempt in await chaos.api.routes(out.request_id):
                reused_on.add(attempt.get("prefill") or attempt.get("decode"))
    # A node's writer thread writes behind its steps, and its stats reach the server a few
    # times a second: under a flood both come late. Its tier turned off (a write failed while
    # read-only), or it wrote a chunk since (its write came once the directory was writable
    # again), within the grace: either is right.
    wrote0 = before.by("pd_node_disk_tier_written", "node")
    deadline = time.monotonic() + READONLY_GRACE_S
    while True:
        alive = (await chaos.monitor.poll()).ids
        metrics = await chaos.api.metrics()
        for n, v in metrics.by("pd_node_disk_tier_off", "node").items():
            if v and n not in off0:
                newly_off.setdefault(n, time.monotonic() - start)
        wrote = metrics.by("pd_node_disk_tier_written", "node")
        late = {n for n in reused_on if wrote.get(n, 0) > wrote0.get(n, 0)} - set(newly_off)
        missed = sorted(n for n in reused_on - off0 - set(newly_off) - late if n in alive)
        if not missed or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    rec.notes.append(
        f"read-only {time.monotonic() - start:.0f} s; {len(asked)} fresh prompts asked twice "
        f"({sum(1 for o in flat if o.cached_tokens)} answers from cached tokens, on "
        f"{sorted(reused_on) or 'no node'}; {sum(o.complete for o in flat)} whole): "
        + (
            "tier off on " + ", ".join(f"{n} after {t:.1f} s" for n, t in sorted(newly_off.items()))
            if newly_off
            else "no node turned its tier off"
        )
        + (f" (off before: {sorted(off0)})" if off0 else "")
        + (f"; {sorted(late)} wrote chunks once it was writable again" if late else "")
    )
    if missed:
        rec.failures.append(
            f"{missed} reused fresh prefixes while the disk tier was read-only, yet their tier "
            "stayed on (pd_node_disk_tier_off 0)"
        )


async def _asked(chaos: Chaos, http: httpx.AsyncClient, specs: list[Spec]) -> list[Spec]:
    """The specs whose reference answer came (asked before the directory is harmed)."""
    got = await asyncio.gather(*(_reference(chaos, http, s) for s in specs))
    return [s for s, ok in zip(specs, got) if ok]


async def _twice(chaos: Chaos, http: httpx.AsyncClient, spec: Spec) -> list[Outcome]:
    """``spec`` asked twice more, one after the other: the reuse writes its chunks through."""
    return [
        await send(http, spec, chaos.api.headers(), chaos.cfg.deadline_s, "disk") for _ in range(2)
    ]


@fault("planted-chunk", "nodes", needs="disk")
async def planted_chunk(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    cfg = chaos.cfg
    if cfg.disk_dir is None:
        rec.notes.append("skipped: no disk tier directory")
        return
    async with chaos.disk_lock:
        chunks = sorted(cfg.disk_dir.glob("*/*.kv"), key=_mtime, reverse=True)
        if not chunks:
            rec.notes.append("skipped: no chunk in the disk tier yet")
            return
        file = chunks[0]
        forged = await asyncio.to_thread(plant_over, file, rng.randrange(2**32))
        rec.notes.append(f"planted a forgery of {file.name} ({len(forged)} bytes, another key)")
        ids0 = set((await chaos.monitor.poll()).ids)
        rejected0 = (await chaos.api.metrics()).by("pd_node_disk_tier_rejected", "node")
        await kill(chaos, rec, rng, rng.choice(ROLES))
        new = sorted((await chaos.monitor.poll()).ids - ids0)
        rejected = (await chaos.api.metrics()).by("pd_node_disk_tier_rejected", "node")
        refused = {
            n: v - rejected0.get(n, 0) for n, v in rejected.items() if v > rejected0.get(n, 0)
        }
        still = file.exists() and file.read_bytes() == forged
        rec.notes.append(
            f"{new or 'no node'} started since; the forgery "
            + ("STILL THERE" if still else "removed")
            + "; files refused since: "
            + (", ".join(f"{n} {v:.0f}" for n, v in sorted(refused.items())) or "none counted")
        )
        if still and new:
            rec.failures.append(
                f"planted chunk {file.name} still in place after {new} started on the directory"
            )


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except FileNotFoundError:
        return 0.0
