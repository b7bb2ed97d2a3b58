"""Prometheus metrics of the HTTP server, one registry per app (tests build many apps).

Request metrics are recorded by the server itself. Cluster gauges come from a ``stats_fn``
callback the cluster provides, called on every scrape of ``/metrics``; it returns a
``ClusterStats``: each node's latest ``NodeStatsMsg`` (counts cumulative since the node started)
and the requests waiting for a node.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pd.core.messages import NodeStatsMsg
from pd.core.outputs import ClusterStats

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# the last four: what a node holds open (leak checks: each returns to its idle level)
_NODE_FIELDS = (
    "queue_depth", "running", "slots_used", "slots_total",
    "pair_groups", "sockets", "threads", "pending_transfers",
)  # fmt: skip
_CACHE_FIELDS = ("cache_hit_tokens", "prompt_tokens")
# NodeStatsMsg field -> (metric name after pd_node_, help)
_NODE_COUNTERS = {
    "num_dropped_msgs": ("dropped_messages", "malformed messages dropped by its sockets"),
    "num_rejected_msgs": (
        "rejected_messages",
        "frames its sockets refused (failed authentication)",
    ),
    "num_retracted": ("retractions", "running requests retracted for want of KV slots"),
    "num_pauses": (
        "pauses",
        "requests left out of its steps because their client fell behind (resumed as it reads)",
    ),
    "num_spec_steps": ("spec_verify_steps", "decode rows that verified a speculative draft"),
    "num_draft_tokens": ("spec_draft_tokens", "speculative tokens drafted and verified"),
    "num_accepted_draft_tokens": (
        "spec_accepted_tokens",
        "of those, accepted (acceptance rate: this / spec_draft_tokens; tokens per verify "
        "step: 1 + this / spec_verify_steps)",
    ),
    "num_host_slots": ("host_tier_slots", "KV slots of its host tier (0: none)"),
    "num_host_cached_tokens": ("host_tier_cached_tokens", "tokens its host tier holds"),
    "num_host_hit_tokens": (
        "host_tier_hit_tokens",
        "prompt tokens loaded back from its host tier (of cache_hit_tokens)",
    ),
    "num_host_loads": ("host_tier_loads", "loads from its host tier"),
    "host_load_bytes": ("host_tier_load_bytes", "KV bytes loaded from its host tier"),
    "host_load_seconds": ("host_tier_load_seconds", "time spent loading from its host tier"),
    "num_host_skipped": (
        "host_tier_skipped",
        "host-tier hits computed instead, as timed faster than loading",
    ),
    "disk_bytes": ("disk_tier_bytes", "bytes its disk tier's directory holds"),
    "num_disk_hit_tokens": (
        "disk_tier_hit_tokens",
        "prompt tokens loaded from its disk tier (of cache_hit_tokens)",
    ),
    "num_disk_loads": ("disk_tier_loads", "chunks loaded from its disk tier"),
    "disk_load_bytes": ("disk_tier_load_bytes", "KV bytes loaded from its disk tier"),
    "disk_load_seconds": ("disk_tier_load_seconds", "time spent reading and loading chunks"),
    "num_disk_written": ("disk_tier_written", "chunks written to its disk tier"),
    "num_disk_rejected": (
        "disk_tier_rejected",
        "disk chunks found truncated, corrupt, unauthenticated or foreign, and removed",
    ),
    "disk_off": (
        "disk_tier_off",
        "1 once its disk tier turned itself off after a file-system error (logged; the node "
        "serves on without it until restarted)",
    ),
    "num_prefill_tokens": ("prefill_tokens", "prompt tokens computed in pure prefill batches"),
    "prefill_seconds": ("prefill_seconds", "time those pure prefill batches took"),
    "num_pulls": ("pulls", "prefixes it asked another node for (pulls)"),
    "num_pulls_failed": (
        "pulls_failed",
        "pulls that did not come (refused, holder gone or stalled): computed instead",
    ),
    "num_pulled_tokens": ("pulled_tokens", "prompt tokens whose KV came by a pull"),
    "pull_bytes": ("pull_bytes", "KV bytes that came by pulls"),
    "pull_seconds": ("pull_seconds", "time from ask to cached, of the pulls that came"),
    "num_pulls_served": ("pulls_served", "prefixes it sent to another node that pulled them"),
    "num_transfer_retries": (
        "transfer_retries",
        'KV transfer requests it sent again after a "no room" answer',
    ),
    "num_held_transfers": (
        "held_transfers",
        "KV transfer requests it held until their request reached it, instead of refusing them",
    ),
}
# ClusterStats field -> (metric name, help) of the server side
_SERVER_COUNTERS = {
    "num_rejected_msgs": (
        "pd_server_rejected_messages",
        "Frames the server's socket refused (failed authentication)",
    ),
    "num_dropped_msgs": (
        "pd_server_dropped_messages",
        "Authentic node messages the server dropped (malformed, or their handler raised)",
    ),
    "num_reader_restarts": (
        "pd_server_reader_restarts",
        "Times the server's reader of node messages died and was restarted",
    ),
    "num_rerouted": (
        "pd_rerouted_requests",
        "Requests moved off a dead node before they streamed a token",
    ),
    "num_failed_nodes": ("pd_failed_nodes", "Nodes found dead"),
    "num_local_prefills": (
        "pd_local_prefills",
        "Requests prefilled on their decode node (conditional disaggregation: no KV transfer)",
    ),
    "num_pulls_chosen": (
        "pd_pull_decisions_pull",
        "Routes where pulling a prefix from another node was estimated faster than computing it",
    ),
    "num_pulls_computed": (
        "pd_pull_decisions_compute",
        "Routes where another node held more of the prompt but computing it was estimated faster",
    ),
    "num_pull_fallbacks": (
        "pd_pull_fallbacks",
        "Pulls chosen that did not come (refused, holder gone or stalled): computed instead",
    ),
    "num_stalled_streams": (
        "pd_server_stalled_streams",
        "Streams ended because their client, paused behind, did not catch up within "
        "stream_pause_timeout_s",
    ),
    "num_duplicate_token_msgs": (
        "pd_server_duplicate_token_messages",
        "Token messages from nodes dropped because their tokens had come already",
    ),
    "num_token_gaps": (
        "pd_server_token_gaps",
        "Token messages that came after lost ones (the node is asked to send them again)",
    ),
    "num_token_resends": (
        "pd_server_token_resends",
        "Times a node was asked to send a request's output again (after a gap, or a silence)",
    ),
    "num_failovers": (
        "pd_server_failovers",
        "Started requests resumed on another decode node from their output, theirs having died",
    ),
}


def _latency(name: str, help_: str, registry: CollectorRegistry) -> Histogram:
    """A histogram of seconds: every latency metric shares ``_LATENCY_BUCKETS``."""
    return Histogram(name, help_, registry=registry, buckets=_LATENCY_BUCKETS)


class ServerMetrics:
    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = _latency(
            "pd_time_to_first_token_seconds", "Request arrival to first output token.", r
        )
        self.tpot = _latency(
            "pd_time_per_output_token_seconds",
            "Per request: (last token - first token) / (output tokens - 1).",
            r,
        )
        self.e2e = _latency("pd_e2e_request_latency_seconds", "Request arrival to finish.", r)
        self.prompt_tokens = Counter("pd_prompt_tokens", "Prompt tokens.", registry=r)
        self.cached_prompt_tokens = Counter(
            "pd_cached_prompt_tokens", "Prompt tokens served from a prefix cache.", registry=r
        )
        self.generation_tokens = Counter("pd_generation_tokens", "Output tokens.", registry=r)
        self.requests = Counter(
            "pd_requests", "Finished requests by finish reason.", ["finish_reason"], registry=r
        )
        self.running = Gauge("pd_server_running_requests", "Requests in flight.", registry=r)
        self.admitted = Gauge(
            "pd_server_admitted_requests", "Requests holding an admission place.", registry=r
        )
        self.queued = Gauge(
            "pd_server_queued_requests", "Requests waiting for admission (FIFO).", registry=r
        )
        self.queue_wait = _latency(
            "pd_server_queue_wait_seconds", "Time admitted requests waited in the queue.", r
        )
        self.rejected = Counter(
            "pd_server_rejected_requests",
            "Requests the server refused or cut off, by reason (queue_full, not_ready, "
            "timeout, body_too_large, body_timeout, bodies_in_flight, header_timeout, "
            "too_many_connections, shutting_down, unauthorized).",
            ["reason"],
            registry=r,
        )
        self.client_gone = Counter(
            "pd_server_client_gone",
            "Requests whose client went away, by where: sending its body (body), waiting for "
            "admission (queued), while it ran (running), or cut off for reading nothing for "
            "stream_write_timeout_s (stalled).",
            ["where"],
            registry=r,
        )

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
        # per node, cumulative counters of what went wrong (or was worked around) there
        self.node_counters = {
            attr: Gauge(f"pd_node_{name}", f"Per node, cumulative: {help_}.", ["node"], registry=r)
            for attr, (name, help_) in _NODE_COUNTERS.items()
        }
        self.coordinator_queue = Gauge(
            "pd_coordinator_queue_depth", "Requests not yet assigned to a node.", registry=r
        )
        self.queued_token_bytes = Gauge(
            "pd_server_queued_token_bytes",
            "Bytes of token messages queued for streams' readers now (pd.core.backlog).",
            registry=r,
        )
        self.server_counters = {
            attr: Gauge(name, f"{help_}, cumulative.", registry=r)
            for attr, (name, help_) in _SERVER_COUNTERS.items()
        }
        # labels bounded: the server and each node report their top few senders only
        self.rejected_by_peer = Gauge(
            "pd_rejected_messages_by_peer",
            "Frames refused (failed authentication), cumulative, by receiver (the server or a "
            "node) and sending address: the few addresses that sent each receiver the most.",
            ["receiver", "peer"],
            registry=r,
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

    def update_stats(self, stats: ClusterStats) -> None:
        """Set the cluster gauges from a ``stats_fn()`` result."""
        for g in (*self.node_gauges.values(), self.node_slot_usage):
            g.clear()
        for g in (*self.cache_gauges.values(), self.cache_hit_rate, *self.node_counters.values()):
            g.clear()
        self.rejected_by_peer.clear()
        for peer, n in stats.rejected_by_peer.items():
            self.rejected_by_peer.labels(receiver="server", peer=peer).set(n)
        for s in stats.nodes:
            self._set_node(s)
        self.transfer_bytes.set(sum(s.transfer_bytes for s in stats.nodes))
        self.transfer_seconds.set(sum(s.transfer_seconds for s in stats.nodes))
        self.transfer_count.set(sum(s.num_transfers for s in stats.nodes))
        self.coordinator_queue.set(stats.num_queued)
        for attr, gauge in self.server_counters.items():
            gauge.set(getattr(stats, attr))
        self.queued_token_bytes.set(stats.num_queued_token_bytes)

    def _set_node(self, s: NodeStatsMsg) -> None:
        labels = {"node": s.node_id, "role": s.role}
        used = s.num_slots - s.num_free_slots
        for name, value in (
            ("queue_depth", s.num_waiting),
            ("running", s.num_running),
            ("slots_used", used),
            ("slots_total", s.num_slots),
            ("pair_groups", s.num_pairs),
            ("sockets", s.num_sockets),
            ("threads", s.num_threads),
            ("pending_transfers", s.num_transferring),
        ):
            self.node_gauges[name].labels(**labels).set(value)
        if s.num_slots:
            self.node_slot_usage.labels(**labels).set(used / s.num_slots)
        prompt = s.num_hit_tokens + s.num_miss_tokens
        self.cache_gauges["cache_hit_tokens"].labels(node=s.node_id).set(s.num_hit_tokens)
        self.cache_gauges["prompt_tokens"].labels(node=s.node_id).set(prompt)
        self.cache_hit_rate.labels(node=s.node_id).set(s.num_hit_tokens / prompt if prompt else 0.0)
        for attr, gauge in self.node_counters.items():
            gauge.labels(node=s.node_id).set(getattr(s, attr))
        for peer, n in s.rejected_by_peer.items():
            self.rejected_by_peer.labels(receiver=s.node_id, peer=peer).set(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
