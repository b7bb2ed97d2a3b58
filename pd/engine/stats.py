"""What an engine core reports: its scheduler's, cache's, tiers' and allocator's counters, and
a role's transfer counters, mapped onto the fields of ``NodeStatsMsg`` (what a node publishes as
its heartbeat and the colocated engine gives ``/metrics``). One place names each field."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pd.cache import DiskStats, TierStats
from pd.core.messages import NodeStatsMsg

if TYPE_CHECKING:
    from pd.engine.core import EngineCore, TransferCounters


def stats_msg(core: EngineCore, role: str, transfer: TransferCounters) -> NodeStatsMsg:
    s = core.scheduler.stats()
    return NodeStatsMsg(
        node_id=core.node_id,
        role=role,
        num_waiting=s.num_waiting,
        num_running=s.num_running,
        num_transferring=transfer.num_transferring,
        num_slots=core.allocator.num_slots,
        num_free_slots=core.allocator.num_free_slots,
        num_cached_tokens=core.cache.num_cached_tokens,
        num_hit_tokens=s.num_cached_tokens,
        num_miss_tokens=s.num_prompt_tokens - s.num_cached_tokens,
        num_queued_tokens=s.num_queued_tokens,
        transfer_bytes=transfer.num_bytes,
        transfer_seconds=transfer.num_seconds,
        transfer_wire_seconds=transfer.num_wire_seconds,
        num_transfers=transfer.num_done,
        num_dropped_msgs=transfer.num_dropped_msgs,
        num_retracted=s.num_retracted,
        num_spec_steps=s.num_spec_steps,
        num_draft_tokens=s.num_draft_tokens,
        num_accepted_draft_tokens=s.num_accepted_tokens,
        num_prefill_tokens=core.num_prefill_tokens,
        prefill_seconds=core.prefill_seconds,
        **_tier_fields(core.cache.tier_stats),
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
