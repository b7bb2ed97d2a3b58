"""``EngineCore``: the model runner, its KV pool, the prefix cache and a scheduler, with one step.

The colocated ``Engine`` and every node own one. ``step()`` reads as three calls:
``schedule()`` -> ``run()`` -> ``postprocess()``, and it is the one place where a failed forward
is handled: the requests of that batch fail (and are released), so the next step cannot trip
over them again. A request whose own sampling fails fails alone (``Scheduler.postprocess``).
"""

from __future__ import annotations

import functools
import itertools
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from pd.cache import DiskStats, TierStats, make_prefix_cache
from pd.core.kv_pool import SlotAllocator
from pd.core.messages import NodeStatsMsg
from pd.core.request import Req
from pd.core.sampling_params import SamplingParams
from pd.engine.config import EngineConfig
from pd.engine.host_pool import HostKVPool, host_tier_slots, make_disk_tier
from pd.engine.runner import ModelRunner
from pd.engine.sampler import make_generator
from pd.engine.scheduler import ScheduledBatch, Scheduler, StepResult
from pd.model.tokenizer import eos_token_ids, load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class TransferCounters(NamedTuple):
    """A node's KV transfer counters, cumulative since it started."""

    num_transferring: int = 0  # transfers (or expected requests) open now
    num_bytes: int = 0
    num_seconds: float = 0.0  # from each transfer's start (before its last forward) to done
    num_wire_seconds: float = 0.0  # ... from its KV all computed to done: what is not hidden
    num_done: int = 0
    num_dropped_msgs: int = 0  # malformed messages the node dropped


_NO_TRANSFERS = TransferCounters()


# A role's look at a batch before it runs; what it returns is called as each layer finishes.
BatchHook = Callable[[ScheduledBatch], Callable[[int], None] | None]


def _both(
    first: Callable[[int], None] | None, second: Callable[[int], None] | None
) -> Callable[[int], None] | None:
    if first is None or second is None:
        return first or second

    def on_layer(layer: int) -> None:
        first(layer)
        second(layer)

    return on_layer


class EngineCore:
    def __init__(
        self,
        cfg: EngineConfig,
        node_id: str = "engine",
        scheduler_cls: type[Scheduler] = Scheduler,
    ) -> None:
        self.cfg = cfg
        self.node_id = node_id
        self.runner = ModelRunner(cfg)
        self.allocator = SlotAllocator(cfg.max_total_tokens, cfg.page_size)
        num_host = host_tier_slots(cfg, self.runner.pool.num_bytes_per_token)
        host = HostKVPool(self.runner.pool, num_host) if num_host else None
        runner = self.runner
        disk = (
            make_disk_tier(cfg, runner.model_dir, runner.pool, runner.quantization)
            if host
            else None
        )
        self.cache = make_prefix_cache(cfg.enable_prefix_cache, self.allocator, node_id, host, disk)
        self.scheduler = scheduler_cls(
            self.allocator,
            self.cache,
            max_running_requests=cfg.max_running_requests,
            max_prefill_tokens=cfg.max_prefill_tokens,
            max_mixed_prefill_tokens=cfg.max_mixed_prefill_tokens,
            new_token_ratio=cfg.new_token_ratio,
            max_model_len=self.runner.max_model_len,
            eos_token_ids=eos_token_ids(self.runner.model_dir),
            num_speculative_tokens=cfg.speculative_tokens,
            max_speculative_batch=cfg.speculative_max_batch,
        )
        self._ids = itertools.count()
        self._rng = random.Random(cfg.seed)  # seeds for requests that bring none
        self.num_prefill_tokens = 0  # computed in pure prefill batches, and the time they took
        self.prefill_seconds = 0.0

    @functools.cached_property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The HF tokenizer, loaded when first asked for: a node only takes and gives token
        ids and never asks (``tokenizer_eos_id`` has why)."""
        return load_tokenizer(self.runner.model_dir)

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def make_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        namespace: str = "",
    ) -> Req:
        """A checked request (ValueError, with the numbers, if it can never run here)."""
        vocab = self.runner.model_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {vocab})")
        req = Req(request_id, list(prompt_ids), params, namespace)
        self.scheduler.check_request(req)
        req.generator = make_generator(params, self._rng.randrange(2**31))
        return req

    def step(
        self,
        before_run: BatchHook | None = None,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> StepResult:
        """Schedule, run and postprocess one batch. ``before_run(batch)`` is a role's look at
        the batch before its forward; what it returns, and ``on_layer_done`` (e.g. a node's
        heartbeat), are called with i as layer i's K/V of the new tokens is in the pool."""
        batch = self.scheduler.schedule()
        if batch is None:
            return StepResult([], [])
        try:
            on_layer = _both(before_run(batch) if before_run is not None else None, on_layer_done)
            banned = [self._banned(r) for r in batch.reqs]
            t0 = time.perf_counter()
            rows = self.runner.run(batch.reqs, batch.seqs, on_layer, banned, batch.drafts)
            if batch.num_decode == 0:  # a pure prefill: the speed a load or pull must beat
                num_tokens = sum(len(s.new_token_ids) for s in batch.seqs)
                seconds = time.perf_counter() - t0
                self.cache.note_prefill(num_tokens, seconds)
                self.num_prefill_tokens += num_tokens
                self.prefill_seconds += seconds
        except Exception as e:  # fail this batch's requests rather than retry them forever
            logger.exception("%s: forward of %d requests failed", self.node_id, len(batch.reqs))
            failed = self.scheduler.fail_batch(batch, f"forward failed: {e}")
            return StepResult([], failed, len(failed))
        return self.scheduler.postprocess(batch, rows)

    def _banned(self, req: Req) -> frozenset[int]:
        """What ``req`` must not sample now: its stop ids (and EOS) before ``min_tokens``."""
        p = req.params
        if len(req.output_ids) >= p.min_tokens:
            return frozenset()
        eos = frozenset() if p.ignore_eos else self.scheduler.eos_token_ids
        return eos | frozenset(p.stop_token_ids)

    def stats(self, role: str, transfer: TransferCounters = _NO_TRANSFERS) -> NodeStatsMsg:
        """This engine's gauges and counters; a node adds its transfer counters."""
        s = self.scheduler.stats()
        return NodeStatsMsg(
            node_id=self.node_id,
            role=role,
            num_waiting=s.num_waiting,
            num_running=s.num_running,
            num_transferring=transfer.num_transferring,
            num_slots=self.allocator.num_slots,
            num_free_slots=self.allocator.num_free_slots,
            num_cached_tokens=self.cache.num_cached_tokens,
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
            num_prefill_tokens=self.num_prefill_tokens,
            prefill_seconds=self.prefill_seconds,
            **_tier_fields(self.cache.tier_stats),
        )

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()


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
    }
