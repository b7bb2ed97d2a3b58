"""What an engine core reports: its scheduler's, cache's, tiers' and allocator's counters, and
a role's transfer counters, mapped onto the fields of ``NodeStatsMsg`` (what a node publishes as
its heartbeat and the colocated engine gives ``/metrics``). One place names each field."""

from __future__ import annotations

from typing import NamedTuple

from pd.cache import DiskStats, TierStats
from pd.cache.base import BasePrefixCache
from pd.core.kv_pool import SlotAllocator
from pd.core.messages import NodeStatsMsg
from pd.engine.scheduler import Scheduler


class TransferCounters(NamedTuple):
    """A node's KV transfer counters, cumulative since it started."""

    num_transferring: int = 0  # transfers (or expected requests) open now
    num_bytes: int = 0
    num_seconds: float = 0.0  # from each transfer's start (before its last forward) to done
    num_wire_seconds: float = 0.0  # ... from its KV all computed to done: what is not hidden
    num_done: int = 0
    num_dropped_msgs: int = 0  # malformed messages the node dropped


class PrefillCounters(NamedTuple):
    """Tokens computed in pure prefill batches, and the seconds they took."""

    num_tokens: int
    seconds: float


def stats_msg(
    node_id: str,
    role: str,
    scheduler: Scheduler,
    allocator: SlotAllocator,
    cache: BasePrefixCache,
    prefill: PrefillCounters,
    transfer: TransferCounters,
) -> NodeStatsMsg:
    s = scheduler.stats()
    return NodeStatsMsg(
        node_id=node_id,
        role=role,
        num_waiting=s.num_waiting,
        num_running=s.num_running,
        num_transferring=transfer.num_transferring,
        num_slots=allocator.num_slots,
        num_free_slots=allocator.num_free_slots,
        num_cached_tokens=cache.num_cached_tokens,
        num_hit_tokens=s.num_cached_tokens,
        num_miss_tokens=s.num_prompt_tokens - s.num_cached_tokens,
        num_queued_tokens=s.num_queued_tokens,
        transfer_bytes=transfer.num_bytes,
        transfer_seconds=transfer.num_seconds,
        transfer_wire_seconds=transfer.num_wire_seconds,
        num_transfers=transfer.num_done,
        num_dropped_msgs=transfer.num_dropped_msgs,
        num_retracted=s.num_retracted,
        num_pauses=s.num_pauses,
        num_spec_steps=s.num_spec_steps,
        num_draft_tokens=s.num_draft_tokens,
        num_accepted_draft_tokens=s.num_accepted_tokens,
        num_prefill_tokens=prefill.num_tokens,
        prefill_seconds=prefill.seconds,
        **_tier_fields(cache.tier_stats),
    )


def _tier_fields(t: TierStats | None) -> dict[str, int | float]:
    """The host tier's counters as NodeStatsMsg fields."""
    if t is None:
        return {}
    return {
        "num_host_slots": t.num_slots,
        "num_host_cached_tokens": t.num_cached_tokens,
        "num_host_hit_tokens": t.num_hit_tokens,
        "num_host_loads": t.num_loads,
        "host_load_bytes": t.num_load_bytes,
        "host_load_seconds": t.load_seconds,
        "num_host_skipped": t.num_skipped,
        **_disk_fields(t.disk),
    }


def _disk_fields(d: DiskStats | None) -> dict[str, int | float]:
    """The disk tier's counters as NodeStatsMsg fields."""
    if d is None:
        return {}
    return {
        "disk_bytes": d.num_bytes,
        "num_disk_hit_tokens": d.num_hit_tokens,
        "num_disk_loads": d.num_loads,
        "disk_load_bytes": d.num_load_bytes,
        "disk_load_seconds": d.load_seconds,
        "num_disk_written": d.num_written,
        "num_disk_rejected": d.num_rejected,
        "disk_off": int(d.is_off),
    }
