"""The hostile tenant's lane (issue 55): one API key of its own (``Settings.hostile_key``)
sends, beside the steady load, the requests round three found could freeze the server, kill
nodes or exhaust its memory, and each one's outcome is judged here (a hostile request has no
reference answer; what it must get is written beside it):

- ``tool-call-traps`` (item 1): chat with ``tools`` (auto) and a regex that forces
  ``<tool_call>`` and 3,000 spaces, and one that forces a call whose arguments nest 1,000
  deep: each a completed answer (200), never a 500;
- ``big-schema`` (items 2, 10): ``n=16`` under a JSON schema just within the server's
  character bound (``MAX_GRAMMAR_CHARS``): a completed answer, or a 400 that names the
  grammar's budget; no node found dead (its compile stalled no heartbeat);
- ``limit-edges`` (item 10): a schema and ``tools`` one character past the bound, an
  assistant's ``tool_calls`` past the context: a 400 naming the bound (a 429 while a flood
  holds every admission place, which comes before the body is read, is asked again);
- ``stopped-readers`` (item 3): streamed ``n=16``, ``top_logprobs=20`` answers whose clients
  stop reading for ``stall_s``: each ends (whole, or cut by an error event or the server's
  close), and the server's memory meanwhile grows by less than ``hostile_rss_mib``;
- ``logprobs-answer`` (item 7): a non-streamed ``n=16``, ``top_logprobs=20`` answer of
  ``hostile_tokens`` tokens a choice: 200, 16 choices, 20 alternatives a token;
- ``tpm-no-max`` (item 8, a server with a tokens-per-minute limit): two streamed ``n=16``
  requests without ``max_tokens``: the first's reservation is what its key may produce, so
  where it alone fills the limit the second is a 429 (``Retry-After``); once both are closed
  a small request of the key is answered (the reservations were given back);
- ``pair-strangers`` (item 5): strangers' connections to the nodes' pair-group listeners
  (the ports their processes listen on in the ephemeral range, not advertised), held and
  closed: no node may hold one 10 s later, none may be found dead.

An answer that failed only because its node was one the soak killed or froze is noted, not
failed. The soak's own checks judge the rest of the lane's promise: ``/health`` latency throughout
(``chaos_watch.probe_health``), the server's RSS, and no node found dead unasked
(``chaos_report.run_checks``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from urllib.parse import urlsplit

from pd.server.openai.structured import MAX_GRAMMAR_CHARS
from pdtools.chaos_cluster import listening_ports, rss_mib
from pdtools.chaos_faults import Chaos, FaultRecord, fault
from pdtools.chaos_hardening import _closed_by
from pdtools.chaos_hostile import stalled_reader
from pdtools.chaos_judge import NODE_FAILED
from pdtools.chaos_load import Spec
from pdtools.chaos_peers import hold_strangers
from pdtools.chaos_tenant_http import (
    TOOLS,
    TOP,
    N,
    Reply,
    big_schema,
    chat,
    completed,
    ephemeral_low,
    headers,
    held_stream,
    json_schema,
    post,
)

LIMIT_RETRY_S = 60.0  # how long limit-edges asks again after 429s (a flood's places held)


@fault("tool-call-traps", "tenant")
async def tool_call_traps(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    """Tool-call answers the parser once took seconds (whitespace) or a RecursionError (depth)
    over; each must come back whole."""
    head = r'<tool_call>\n\{"name": "lookup", "arguments": \{"a": '
    traps = {
        "3,000 spaces after <tool_call>, then no call": r'<tool_call> {3000}\{"x": 1\}\n</tool_call>',
        "arguments nested 1,000 deep": head + r"\[{1000}\]{1000}\}\}\n</tool_call>",
    }  # fmt: skip
    room = max(16, min(2400, chaos.cfg.max_model_len - 600))  # the tools take ~300 tokens
    bodies = [
        chat("Look up the word river.", tools=TOOLS, structured_outputs={"regex": regex}, max_tokens=room, temperature=0)
        for regex in traps.values()
    ]  # fmt: skip
    replies = await asyncio.gather(*(post(chaos, "/v1/chat/completions", b) for b in bodies))
    for name, reply in zip(traps, replies, strict=True):
        why = completed(reply)
        rec.notes.append(
            f"{name}: {reply.status} in {reply.seconds:.1f} s" + (f" ({why})" if why else "")
        )
        _judged(chaos, rec, reply, why, f"{name}: want a completed answer")


@fault("big-schema", "tenant")
async def big_schema_n16(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    start = time.monotonic()
    schema = big_schema(MAX_GRAMMAR_CHARS - 64)
    body = chat(
        "Fill the form.", n=N, max_tokens=16, temperature=1.0, response_format=json_schema(schema)
    )
    reply = await post(chaos, "/v1/chat/completions", body)
    budget = reply.status == 400 and "grammar" in reply.error
    why = "" if budget else completed(reply, N)
    rec.notes.append(
        f"n={N} under a schema of {len(json.dumps(schema))} characters: {reply.status} in "
        f"{reply.seconds:.1f} s" + (" (the grammar's budget)" if budget else "")
    )
    _judged(chaos, rec, reply, why, f"n={N}, a big schema: want an answer or a 400 on its budget")
    await _none_dead(chaos, rec, start)


def _judged(chaos: Chaos, rec: FaultRecord, reply: Reply, why: str, want: str) -> None:
    """A failure ``want, why`` unless ``why`` is empty, the reply's error names a node the
    soak killed or froze before it ended (noted: its node was the soak's to kill), or it is the
    429 of a server whose admission places are all taken or the 504 of its request deadline
    (noted: the answers any request gets then, the floods' and the stopped readers' places
    being the soak's own doing)."""
    failed = NODE_FAILED.search(reply.error)
    if why and failed and chaos.doomed.get(failed[1], float("inf")) <= time.monotonic():
        rec.notes.append(f"{want}: its node {failed[1]} was killed or frozen by the soak")
    elif why and reply.status == 429 and reply.code == "server_overloaded":
        rec.notes.append(f"{want}: refused while admission was full ({reply})")
    elif why and reply.status == 504 and reply.code == "request_timeout":
        rec.notes.append(f"{want}: ended at the server's request deadline ({reply})")
    elif why:
        rec.failures.append(f"{want}, {why}")


async def _none_dead(chaos: Chaos, rec: FaultRecord, start: float) -> None:
    """A heartbeat timeout after ``start``: no node found dead that the soak did not doom."""
    await asyncio.sleep(max(0.0, chaos.cfg.heartbeat_s + 1 - (time.monotonic() - start)))
    gone = chaos.left_unasked_since(start)
    if gone:
        rec.failures.append(f"healthy nodes found dead: {gone}")


@fault("limit-edges", "tenant")
async def limit_edges(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    """Fields one past their character bounds: each a 400 that says which and how far."""
    past = MAX_GRAMMAR_CHARS + 1
    pad = {"type": "string", "description": "x" * past}
    tools = [
        {
            **TOOLS[0],
            "function": {
                **TOOLS[0]["function"],
                "parameters": {"type": "object", "properties": {"a": pad}},
            },
        }
    ]
    call = {
        "id": "c1",
        "type": "function",
        "function": {
            "name": "lookup",
            "arguments": json.dumps({"a": "y" * (chaos.cfg.max_body_bytes // 3)}),
        },
    }
    cases = {  # name -> (body, what the 400's message must hold)
        "a schema past the bound": (chat("hi", max_tokens=4, response_format=json_schema({"type": "object", "description": "x" * past})), f"at most {MAX_GRAMMAR_CHARS}"),
        "tools past the bound": (chat("hi", max_tokens=4, tools=tools), f"at most {MAX_GRAMMAR_CHARS}"),
        "an assistant's tool_calls past the context": ({"messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ], "max_tokens": 4}, "context length"),
    }  # fmt: skip
    got = []
    for name, (body, says) in cases.items():
        # a 429 while a flood holds every admission place comes before the body is read:
        # asked again after Retry-After (as a client would), for up to LIMIT_RETRY_S
        reply, refused, until = None, 0, time.monotonic() + LIMIT_RETRY_S
        while True:
            reply = await post(chaos, "/v1/chat/completions", body)
            if not (reply.status == 429 and reply.code == "server_overloaded"):
                break
            if time.monotonic() > until:
                break
            refused += 1
            await asyncio.sleep(0.5 + rng.random())  # Retry-After: 1, jittered
        got.append(
            f"{name}: {reply.status} in {reply.seconds:.1f} s"
            + (f" (after {refused} x 429 while admission was full)" if refused else "")
        )
        why = "" if reply.status == 400 and says in reply.error else f"got {reply}"
        _judged(chaos, rec, reply, why, f"{name}: want a 400 saying {says!r}")
    rec.notes.append("; ".join(got))


@fault("stopped-readers", "tenant")
async def stopped_readers(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    """Two streamed n=16, top_logprobs=20 answers (32 choices: every admission place of a
    server the soak starts) whose clients read nothing for ``stall_s``."""
    rec.pressure = True
    cfg = chaos.cfg
    tokens = max(16, min(cfg.hostile_tokens, cfg.max_model_len - 64))
    body = chat(
        "Tell me a long story about a river.",
        n=N,
        logprobs=True,
        top_logprobs=TOP,
        max_tokens=tokens,
        temperature=1.0,
    )
    spec = Spec("tenant-stopped", "chat", body, True)
    pid = chaos.tree.root
    rss0 = rss_mib(pid) if pid is not None else None
    most = [rss0 or 0.0]

    async def sample() -> None:
        while pid is not None and (rss := rss_mib(pid)) is not None:
            most[0] = max(most[0], rss)
            await asyncio.sleep(0.5)

    sampler = asyncio.get_running_loop().create_task(sample())
    tenant = headers(chaos)
    try:
        outs = await asyncio.gather(
            *(
                stalled_reader(cfg.url, spec, tenant, cfg.stall_s, cfg.stall_s + cfg.deadline_s)
                for _ in range(2)
            )
        )
    finally:
        sampler.cancel()
    ends = []
    for o in outs:
        if o.hang:
            rec.failures.append(f"a stopped reader's stream never ended: {o.error}")
        elif o.status not in (200, 429, None):  # a cut stream: an error event, or closed
            rec.failures.append(f"a stopped reader got {o.status} {o.code} {o.error[:120]!r}")
        ends.append("whole" if o.complete else (o.code or o.error.split(":")[0] or f"{o.status}"))
    growth = most[0] - rss0 if rss0 is not None else 0.0
    rec.notes.append(
        f"2 x n={N}, top_logprobs={TOP}, {tokens} tokens, read nothing for {cfg.stall_s:.0f} s: "
        f"{', '.join(ends)}; server RSS +{growth:.0f} MiB at most (bound {cfg.hostile_rss_mib:g})"
    )
    if growth > cfg.hostile_rss_mib:
        rec.failures.append(
            f"server RSS grew {growth:.0f} MiB under stopped readers (bound {cfg.hostile_rss_mib:g})"
        )


@fault("logprobs-answer", "tenant")
async def logprobs_answer(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    rec.pressure = True  # 16 admission places
    tokens = max(16, min(chaos.cfg.hostile_tokens, chaos.cfg.max_model_len - 64))
    body = chat(
        "Tell me a long story about a bridge.",
        n=N,
        logprobs=True,
        top_logprobs=TOP,
        max_tokens=tokens,
        temperature=1.0,
    )
    reply = await post(chaos, "/v1/chat/completions", body)
    why = completed(reply, N)
    if not why:
        for c in reply.body["choices"]:
            content = (c.get("logprobs") or {}).get("content") or []
            if not content or any(len(t.get("top_logprobs", [])) != TOP for t in content):
                why = f"a choice's logprobs: {len(content)} tokens, not {TOP} alternatives each"
                break
    usage = (reply.body or {}).get("usage", {})
    rec.notes.append(
        f"n={N}, top_logprobs={TOP}, up to {tokens} tokens: {reply.status} in {reply.seconds:.1f} s, {usage.get('completion_tokens')} tokens"
    )
    _judged(chaos, rec, reply, why, f"n={N}, top_logprobs={TOP}: want the whole answer")


AT_ONCE_S = 2.0  # an answer's head this soon: its request was admitted without waiting


@fault("tpm-no-max", "tenant", needs="tpm")
async def tpm_no_max(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    rec.pressure = True  # 32 admission places
    cfg = chaos.cfg
    limit = cfg.tokens_per_minute
    body = chat("Say hello.", n=N, temperature=1.0)
    spec = Spec("tenant-no-max", "chat", body, True)
    # what the first may produce: n x the rest of the context (its prompt is short)
    fills = N * (cfg.max_model_len - 64) >= limit
    headed = asyncio.Event()
    second: list[int | None] = []

    waited: list[float] = []

    async def then_second() -> None:  # while the first is held open
        await headed.wait()
        start = time.monotonic()
        second.append(await held_stream(chaos, spec, None))
        waited.append(time.monotonic() - start)

    first_status, _ = await asyncio.gather(held_stream(chaos, spec, headed, second), then_second())
    second_status = second[0] if second else None
    # Admitted at once, the second is reserved while the first holds its reservation. One that
    # waited for an admission place may come after the first ended (its client reads nothing:
    # the server ends it at its pause timeout; or the soak killed its node), reservation back.
    at_once = bool(waited) and waited[0] < AT_ONCE_S
    small = await post(chaos, "/v1/chat/completions", chat("hi", max_tokens=4))
    rec.notes.append(
        f"limit {limit} tokens a minute; two n={N} without max_tokens: {first_status}, "
        f"{second_status} (the first fills the limit: {fills}); then a small request: {small.status}"
    )
    if first_status not in (200, 429) or second_status not in (200, 429):
        rec.failures.append(
            f"n={N} without max_tokens: want 200 or 429, got {first_status}, {second_status}"
        )
    if fills and first_status == 200 and second_status != 429 and at_once:
        rec.failures.append(
            f"the second n={N} without max_tokens got {second_status} in {waited[0]:.1f} s: the first's reservation fills the key's {limit} tokens, so it must be a 429"
        )
    elif fills and first_status == 200 and second_status == 200:
        rec.notes.append(f"the second waited {waited[0]:.0f} s for admission: the first had ended")
    if small.status != 200:
        rec.failures.append(
            f"after both ended, the key's small request got {small}: reservations not given back"
        )


@fault("pair-strangers", "tenant")
async def pair_strangers(chaos: Chaos, rec: FaultRecord, rng: random.Random) -> None:
    cfg = chaos.cfg
    pools = await chaos.monitor.poll()
    ready = [
        n
        for n in pools.nodes
        if n["state"] == "ready" and n["pair_groups"] and chaos.tree.owns(n["pid"])
    ]
    low = ephemeral_low()
    ports = {}
    for n in ready:
        told = {urlsplit(n[a]).port for a in ("addr", "transfer_addr") if n[a]}
        ports[n["id"]] = [p for p in listening_ports(n["pid"]) if p >= low and p not in told]
    every = sorted({p for ps in ports.values() for p in ps})
    if not every:
        rec.notes.append("skipped: no node with a pair group listens on an unadvertised port")
        return
    start = time.monotonic()
    mine, num_junk, refused = await asyncio.to_thread(
        hold_strangers, every, cfg.num_strangers, cfg.strangers_hold_s, rng.randrange(2**32)
    )
    rec.target = f"{len(ports)} nodes, {len(every)} pair listeners"
    rec.notes.append(
        f"{len(mine)} connections ({num_junk} sending junk, {refused} refused) held {cfg.strangers_hold_s:g} s"
    )
    await _closed_by(rec, {n["id"]: n["pid"] for n in ready}, mine, "node", closed=True)
    await _none_dead(chaos, rec, start)
