"""Prometheus metrics of the HTTP server, one registry per app (tests build many apps).

Request metrics are recorded by the server itself. Cluster gauges come from a ``stats_fn``
callback the cluster provides, called on every scrape of ``/metrics``; it returns a dict of
this shape (every key optional, unknown keys ignored, counts cumulative since node start):

    {
      "nodes": {
        "<node_id>": {
          "role": "prefill" | "decode",
          "queue_depth": int,        # requests waiting in the node's scheduler
          "running": int,            # requests in the node's running batch
          "slots_used": int,         # KV slots in use (incl. cached prefixes)
          "slots_total": int,
          "cache_hit_tokens": int,   # prompt tokens served from the node's prefix cache
          "prompt_tokens": int,      # prompt tokens the node was asked to prefill
        },
      },
      "transfer": {"bytes": int, "seconds": float, "count": int},  # KV moved prefill -> decode
      "coordinator": {"queue_depth": int},  # requests not yet assigned to a node
    }
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_NODE_FIELDS = ("queue_depth", "running", "slots_used", "slots_total")
_CACHE_FIELDS = ("cache_hit_tokens", "prompt_tokens")


class ServerMetrics:
    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            "pd_time_to_first_token_seconds", "Request arrival to first output token.",
            registry=r, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.tpot = Histogram(
            "pd_time_per_output_token_seconds",
            "Per request: (last token - first token) / (output tokens - 1).",
            registry=r, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.e2e = Histogram(
            "pd_e2e_request_latency_seconds", "Request arrival to finish.",
            registry=r, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.prompt_tokens = Counter("pd_prompt_tokens", "Prompt tokens.", registry=r)
        self.cached_prompt_tokens = Counter(
            "pd_cached_prompt_tokens", "Prompt tokens served from a prefix cache.", registry=r
        )
        self.generation_tokens = Counter("pd_generation_tokens", "Output tokens.", registry=r)
        self.requests = Counter(
            "pd_requests", "Finished requests by finish reason.", ["finish_reason"], registry=r
        )
        self.running = Gauge("pd_server_running_requests", "Requests in flight.", registry=r)

        node = ["node", "role"]
        self.node_gauges = {
            f: Gauge(f"pd_node_{f}", f"Per node: {f} (from the cluster).", node, registry=r)
            for f in _NODE_FIELDS
        }
        self.node_slot_usage = Gauge(
            "pd_node_slot_usage", "Per node: slots_used / slots_total.", node, registry=r
        )
        self.cache_gauges = {
            f: Gauge(f"pd_node_{f}", f"Per prefill node, cumulative: {f}.", ["node"], registry=r)
            for f in _CACHE_FIELDS
        }
        self.cache_hit_rate = Gauge(
            "pd_node_cache_hit_rate",
            "Per prefill node: cache_hit_tokens / prompt_tokens since start.",
            ["node"],
            registry=r,
        )
        self.transfer_bytes = Gauge("pd_transfer_bytes", "KV bytes moved, cumulative.", registry=r)
        self.transfer_seconds = Gauge(
            "pd_transfer_seconds", "KV transfer time, cumulative.", registry=r
        )
        self.transfer_count = Gauge("pd_transfer_count", "KV transfers, cumulative.", registry=r)
        self.coordinator_queue = Gauge(
            "pd_coordinator_queue_depth", "Requests not yet assigned to a node.", registry=r
        )

    def record_first_token(self, arrival: float, first_token: float) -> None:
        self.ttft.observe(first_token - arrival)

    def record_finished(
        self,
        *,
        finish_reason: str,
        num_prompt_tokens: int,
        num_cached_tokens: int,
        num_output_tokens: int,
        arrival: float,
        first_token: float | None,
        last_token: float | None,
        finished: float,
    ) -> None:
        """Times are ``time.perf_counter()`` values; aborted or failed requests count tokens,
        not latency."""
        self.requests.labels(finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.cached_prompt_tokens.inc(num_cached_tokens)
        self.generation_tokens.inc(num_output_tokens)
        if finish_reason not in ("stop", "length") or first_token is None:
            return
        self.e2e.observe(finished - arrival)
        if num_output_tokens > 1 and last_token is not None:
            self.tpot.observe((last_token - first_token) / (num_output_tokens - 1))

    def update_stats(self, stats: Mapping[str, Any]) -> None:
        """Set the cluster gauges from a ``stats_fn()`` dict (shape in the module docstring)."""
        for g in (*self.node_gauges.values(), self.node_slot_usage):
            g.clear()
        for g in (*self.cache_gauges.values(), self.cache_hit_rate):
            g.clear()
        for node_id, node in (stats.get("nodes") or {}).items():
            role = str(node.get("role", ""))
            for f in _NODE_FIELDS:
                if f in node:
                    self.node_gauges[f].labels(node=node_id, role=role).set(node[f])
            if node.get("slots_total"):
                usage = node.get("slots_used", 0) / node["slots_total"]
                self.node_slot_usage.labels(node=node_id, role=role).set(usage)
            if all(f in node for f in _CACHE_FIELDS):
                for f in _CACHE_FIELDS:
                    self.cache_gauges[f].labels(node=node_id).set(node[f])
                rate = (
                    node["cache_hit_tokens"] / node["prompt_tokens"]
                    if node["prompt_tokens"]
                    else 0.0
                )
                self.cache_hit_rate.labels(node=node_id).set(rate)
        transfer = stats.get("transfer") or {}
        for key, gauge in (
            ("bytes", self.transfer_bytes),
            ("seconds", self.transfer_seconds),
            ("count", self.transfer_count),
        ):
            if key in transfer:
                gauge.set(transfer[key])
        coordinator = stats.get("coordinator") or {}
        if "queue_depth" in coordinator:
            self.coordinator_queue.set(coordinator["queue_depth"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
