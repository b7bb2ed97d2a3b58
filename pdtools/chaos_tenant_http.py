"""The hostile tenant's requests (``pdtools.chaos_tenant``): their bodies, and a client that
sends them with the tenant's own key and reports what came, judging nothing.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from pdtools.chaos_faults import Chaos
from pdtools.chaos_load import Spec, parse_error

N = 16  # choices of the wide requests (the server's most)
TOP = 20  # top_logprobs (OpenAI's most)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up",
            "parameters": {"type": "object", "properties": {"a": {}}},
        },
    }
]
DONE = ("stop", "length", "tool_calls")


class Reply:
    """A hostile request's answer (``status`` None: none within the deadline, or a transport
    error in ``error``)."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.body: Any = None
        self.error = ""
        self.code = ""
        self.seconds = 0.0

    def __str__(self) -> str:
        return f"{self.status} {self.code} {self.error[:160]!r}".strip()


def headers(chaos: Chaos) -> dict[str, str]:
    key = chaos.cfg.hostile_key or chaos.api.api_key
    return {"Authorization": f"Bearer {key}"} if key else {}


async def post(chaos: Chaos, path: str, body: dict[str, Any]) -> Reply:
    """POST ``body`` as the hostile tenant, within the client's deadline."""
    out, start = Reply(), time.monotonic()
    limits = httpx.Limits(max_keepalive_connections=0)
    try:
        async with httpx.AsyncClient(base_url=chaos.cfg.url, limits=limits) as http:
            r = await asyncio.wait_for(
                http.post(path, json=body, headers=headers(chaos), timeout=chaos.cfg.deadline_s),
                chaos.cfg.deadline_s,
            )
        out.status = r.status_code
        if r.status_code == 200:
            out.body = r.json()
        else:
            out.error, out.code = parse_error(r.text)
    except asyncio.TimeoutError:
        out.error = f"HANG: no answer within {chaos.cfg.deadline_s:g} s"
    except (httpx.HTTPError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
    out.seconds = time.monotonic() - start
    return out


def completed(reply: Reply, num_choices: int = 1) -> str:
    """'' if ``reply`` is a whole chat answer of ``num_choices`` finished choices, else why."""
    if reply.status != 200:
        return f"got {reply}"
    choices = reply.body.get("choices", [])
    if len(choices) != num_choices or any(c.get("finish_reason") not in DONE for c in choices):
        return f"{len(choices)} choices, finish {[c.get('finish_reason') for c in choices][:4]}"
    return ""


def chat(question: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": question}], **extra}


def big_schema(num_chars: int) -> dict[str, Any]:
    """A JSON schema of at most ``num_chars`` characters of JSON, near that: many objects of
    typed fields, each string's pattern its own (costly to compile, not to send)."""
    props: dict[str, Any] = {}
    size = len(json.dumps({"type": "object", "properties": {}}))
    for i in range(num_chars):
        field = {
            "type": "object",
            "properties": {"n": {"type": "integer"}, "s": {"type": "string", "pattern": f"^[a-z]{{1,{i % 9 + 1}}}x{i}$"}},
            "required": ["n", "s"],
        }  # fmt: skip
        grown = size + len(json.dumps({f"f{i}": field})) - 2 + (2 if props else 0)
        if grown > num_chars:
            break
        props[f"f{i}"], size = field, grown
    return {"type": "object", "properties": props}


def json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


async def held_stream(
    chaos: Chaos, spec: Spec, headed: asyncio.Event | None, until: list[int | None] | None = None
) -> int | None:
    """Start ``spec``'s stream as the hostile tenant: its status once the head comes (set
    ``headed`` then, and hold the stream open until ``until`` is filled, within the deadline),
    then close it: its reservation is given back."""
    limits = httpx.Limits(max_keepalive_connections=0)
    deadline = time.monotonic() + chaos.cfg.deadline_s
    status = None
    try:
        async with httpx.AsyncClient(base_url=chaos.cfg.url, limits=limits) as http:
            req = http.build_request(
                "POST",
                spec.path,
                json=spec.request_body(),
                headers=headers(chaos),
                timeout=chaos.cfg.deadline_s,
            )
            r = await asyncio.wait_for(http.send(req, stream=True), chaos.cfg.deadline_s)
            status = r.status_code
            if headed is not None:
                headed.set()
            while until is not None and not until and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            await r.aclose()
    except (asyncio.TimeoutError, httpx.HTTPError):
        pass
    finally:
        if headed is not None:
            headed.set()
    return status


def ephemeral_low() -> int:
    """The kernel's first ephemeral port: a pair group's listener binds port 0."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# a started server's --max-tokens-per-minute-per-key: far above the steady key's use, below
# what one n=16 request without max_tokens may produce on SmolLM2's 8,192-token context
TOKENS_PER_MINUTE = 120_000
# the soak's flags of the hostile tenant's lane: (flag, type, default, help)
TENANT_FLAGS = (
    ("--tokens-per-minute", int, None, "the server's --max-tokens-per-minute-per-key (a "
     f"started server: {TOKENS_PER_MINUTE}; 0: none, and tpm-no-max is left out)"),
    ("--hostile-api-key", str, None, "the hostile tenant's key (default: a fresh one for a "
     "server the soak starts, else --api-key)"),
    ("--hostile-tokens", int, 1000, "tokens a choice of the hostile tenant's n=16 answers"),
    ("--max-health-p99-ms", float, 250.0, "GET /health's latency, polled throughout: its 99th "
     "percentile's bound"),
)  # fmt: skip
