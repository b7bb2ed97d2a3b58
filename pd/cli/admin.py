"""``pd scale`` and ``pd status``: a running server's pools, over its admin API."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from pd.core import envs

_COLUMNS = (
    "id",
    "role",
    "state",
    "ray_node",
    "load",
    "queued_tokens",
    "kv_usage",
    "cached_tokens",
    "host_cached_tokens",
    "pulled_tokens",
    "pulls_served",
)


class AdminError(RuntimeError):
    """The server refused a call, or could not be reached."""


def call(args: argparse.Namespace, method: str, path: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{args.url.rstrip('/')}{path}", data=data, method=method)
    req.add_header("content-type", "application/json")
    api_key = args.api_key or next(iter((*envs.PD_ADMIN_API_KEY, *envs.PD_API_KEY)), None)
    if api_key:
        req.add_header("authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        try:
            detail = json.loads(detail)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        raise AdminError(f"{method} {path}: HTTP {e.code}: {detail}") from None
    except OSError as e:
        raise AdminError(f"cannot reach the pd server at {args.url}: {e}") from None


def is_settled(pools: dict[str, Any]) -> bool:
    """Every pool has its target size of ready nodes and none starts or drains."""
    nodes = pools["nodes"]
    if any(n["state"] != "ready" for n in nodes):
        return False
    return all(
        sum(n["role"] == role for n in nodes) == size for role, size in pools["target"].items()
    )


def format_pools(pools: dict[str, Any]) -> str:
    target = ", ".join(f"{role} {size}" for role, size in pools["target"].items())
    rows = [_COLUMNS] + [
        tuple(f"{n[c]:.2f}" if c == "kv_usage" else str(n[c] or "-") for c in _COLUMNS)
        for n in pools["nodes"]
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    out = f"target: {target}\n" + "\n".join(lines)
    if (pulls := pools.get("pulls")) and pulls["decisions"]:
        out += "\n" + format_pulls(pulls)
    return out


def format_pulls(pulls: dict[str, Any]) -> str:
    """The coordinator's last pull-or-compute choices, with both estimates and the time the
    pull took."""
    head = (
        f"pulls: {pulls['num_pulls']} chosen, {pulls['num_fallbacks']} computed after all, "
        f"{pulls['num_computed']} estimated slower than computing; last choices:"
    )
    lines = [head]
    for d in pulls["decisions"][-8:]:
        took = "-" if d["pull_s"] is None else f"{d['pull_s'] * 1000:.0f} ms"
        why = f" ({d['error']})" if d["error"] else ""
        lines.append(
            f"  {d['request_id']}: {d['num_tokens']} tokens {d['holder']} -> {d['node']}: "
            f"pull ~{d['est_pull_s'] * 1000:.0f} ms vs compute ~{d['est_compute_s'] * 1000:.0f} ms"
            f" -> {d['choice']}, took {took}{why}"
        )
    return "\n".join(lines)


def scale(args: argparse.Namespace) -> int:
    if args.prefill is None and args.decode is None:
        raise ValueError("give --prefill N and/or --decode M")
    body = {k: v for k, v in (("prefill", args.prefill), ("decode", args.decode)) if v is not None}
    try:
        pools = call(args, "POST", "/admin/scale", body)
        deadline = time.monotonic() + args.timeout
        while args.wait and not is_settled(pools):
            if time.monotonic() > deadline:
                print(format_pools(pools))
                print(f"pd: error: the pools did not settle in {args.timeout} s", file=sys.stderr)
                return 1
            time.sleep(0.5)
            pools = call(args, "GET", "/admin/nodes")
    except AdminError as e:
        print(f"pd: error: {e}", file=sys.stderr)
        return 1
    print(format_pools(pools))
    return 0


def status(args: argparse.Namespace) -> int:
    try:
        pools = call(args, "GET", "/admin/nodes")
    except AdminError as e:
        print(f"pd: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(pools, indent=2) if args.json else format_pools(pools))
    return 0
