"""The cluster client's settings (``ClientConfig``: deadlines and liveness) and the pools it
knows (``ROLES``, ``MIN_POOL``), read by the request plane and the fleet alike."""

from __future__ import annotations

from dataclasses import dataclass

from pd.core.options import option

ROLES = ("prefill", "decode")
# Each pool's smallest size: the prefill pool may be empty (its decode nodes then prefill every
# prompt themselves: ``Coordinator.decode_only``), the decode pool may not.
MIN_POOL = {"prefill": 0, "decode": 1}


@dataclass(frozen=True)
class ClientConfig:
    """Deadlines and liveness of the cluster client."""

    request_timeout_s: float = option(600.0, "a request's deadline, waits for room included")
    heartbeat_timeout_s: float = option(
        10.0,
        "a node whose loop publishes nothing for this long is dead (its loop also beats between "
        "the layers of a forward pass)",
    )
    watch_interval_s: float = 0.25  # how often heartbeats are checked and actors pinged
    ping_timeout_s: float = 10.0  # an unanswered ping is left to the heartbeat to judge
    max_reroutes: int = 1  # times a request that streamed nothing moves off a dead node
    # times a started request resumes on another decode node when its own dies (a failover)
    max_failovers: int = 2
    # a request that streamed nothing and whose KV transfer failed is re-routed after this
    # long, unless a node death explains the failure first (then at once, off that node)
    retry_delay_s: float = 1.0
    token_probe_s: float = option(
        5.0,
        "a request that heard nothing from its nodes for this long has them asked where it "
        "stands: a lost last token frame is sent again, one they no longer know ends at once",
    )

    def __post_init__(self) -> None:
        for name in (
            "request_timeout_s",
            "heartbeat_timeout_s",
            "watch_interval_s",
            "token_probe_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if min(self.max_reroutes, self.max_failovers, self.retry_delay_s) < 0:
            raise ValueError(
                f"max_reroutes ({self.max_reroutes}), max_failovers ({self.max_failovers}) and "
                f"retry_delay_s ({self.retry_delay_s}) must be >= 0"
            )
