"""One streamed request to an OpenAI-compatible server, timed; and its /metrics counters. Also
one greedy ``/generate`` of pd, timed to its first token (``bench_pull``, ``bench_replace``)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdtools.bench_workloads import Request


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    text: str = ""  # the whole answer (the tables compare answers between servers)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def request_body(args: argparse.Namespace, req: Request) -> dict[str, Any]:
    max_tokens = req.max_tokens or args.max_tokens
    body: dict[str, Any] = {
        "model": args.model,
        "max_tokens": max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if req.messages is not None:
        body["messages"] = req.messages
    else:
        body["prompt"] = req.prompt
    if args.ignore_eos:  # every request runs max_tokens
        body["ignore_eos"] = True  # vLLM/SGLang/pd
        body["min_tokens"] = max_tokens  # llama-cpp-python (and vLLM): no EOS before this
    return body


def _output_text(choice: dict[str, Any]) -> str | None:
    """The new text of a completion or chat chunk."""
    if "delta" in choice:
        return (choice["delta"] or {}).get("content")
    return choice.get("text")


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, req: Request) -> Result:
    res = Result(ok=False)
    start = last = time.perf_counter()
    num_chunks = 0
    try:
        async with client.stream("POST", req.path, json=request_body(args, req)) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    res.error = str(event["error"].get("message"))
                    return res
                if event.get("usage"):
                    usage = event["usage"]
                    res.prompt_tokens = usage["prompt_tokens"]
                    res.output_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens") or 0
                choice = event["choices"][0] if event.get("choices") else {}
                # a first token may decode to no text yet (a partial UTF-8 byte): the finish
                # chunk then marks the first output, else TTFT would be undefined
                res.text += _output_text(choice) or ""
                if _output_text(choice) or (num_chunks == 0 and choice.get("finish_reason")):
                    now = time.perf_counter()
                    if num_chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    last = now
                    num_chunks += 1
    except httpx.HTTPError as e:
        res.error = repr(e)
        return res
    res.e2e = time.perf_counter() - start
    res.output_tokens = res.output_tokens or num_chunks  # servers without usage in streams
    res.ok = num_chunks > 0
    res.error = "" if res.ok else "no output"
    return res


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """Sum of each sample name in /metrics (labels dropped); {} when there is none."""
    try:
        r = await client.get("/metrics")
    except httpx.HTTPError:
        return {}
    if r.status_code != 200:
        return {}
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def generate_ttft(url: str, ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Seconds to the first streamed token of a greedy ``/generate`` of pd, and all the tokens."""
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
        "stream": True,
    }
    start, first, tokens = time.perf_counter(), 0.0, []
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event["output_ids"] and not first:
                first = time.perf_counter() - start
            tokens.extend(event["output_ids"])
    return first, tokens
