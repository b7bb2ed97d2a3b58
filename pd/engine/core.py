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
from typing import TYPE_CHECKING

from pd.cache import make_prefix_cache
from pd.core.kv_pool import SlotAllocator
from pd.core.messages import NodeStatsMsg
from pd.core.request import Req
from pd.core.sampling_params import SamplingParams
from pd.engine.scheduler import ScheduledBatch, Scheduler, StepResult
from pd.engine.stats import PrefillCounters, TransferCounters, stats_msg
from pd.executor.config import EngineConfig
from pd.executor.grammar import GrammarCompiler
from pd.executor.host_pool import make_disk_tier
from pd.executor.runner import ModelRunner
from pd.executor.sampler import make_generator, skip_draws
from pd.model.tokenizer import eos_token_ids, load_tokenizer
from pd.parallel.group import TensorParallelError
from pd.parallel.ranks import RankLink

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


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
        machine_nodes: int = 1,
        staged: bool = False,
    ) -> None:
        """``machine_nodes``: engines that may share this machine's memory (the host tier's
        default takes its share); ``staged``: a node of a cluster, whose KV the transfer plane
        moves (a tensor-parallel one keeps every head in rank 0's staging pool for it)."""
        self.cfg = cfg
        self.node_id = node_id
        self.staged = staged
        # a tensor-parallel node's link to its other ranks (``pd.parallel``), which the runner
        # starts and closes
        self.ranks = (
            RankLink(cfg, machine_nodes=machine_nodes, staged=staged)
            if cfg.tensor_parallel_size > 1
            else None
        )
        self.runner = ModelRunner(cfg, machine_nodes=machine_nodes, ranks=self.ranks)
        # set when a rank of this tensor-parallel node is gone: every later step raises it
        self.fatal_error: str | None = None
        self.allocator = SlotAllocator(self.runner.num_slots, cfg.page_size)
        host = self.runner.make_host_pool()
        runner = self.runner
        disk = (
            make_disk_tier(
                cfg,
                runner.model_dir,
                runner.pool,
                runner.quantization,
                runner.model_config.num_kv_heads,
            )
            if host
            else None
        )
        self.cache = make_prefix_cache(
            cfg.enable_prefix_cache, self.allocator, node_id, host, disk, cfg.cache_shares()
        )
        # requests' grammars, compiled off this engine's thread (a request waits for its own)
        self.grammars = GrammarCompiler(
            lambda: runner.grammar_tokenizer, cfg.max_grammar_chars, cfg.grammar_timeout_s
        )
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
            is_ready=self.grammars.prepare,
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
        output_ids: Sequence[int] = (),
    ) -> Req:
        """A checked request (ValueError, with the numbers, if it can never run here); its
        grammar, if any, starts compiling now (off this thread: it runs once compiled).

        ``output_ids``: a request resumed here (a failover: its decode node died) with the
        output it had. They are prefilled after the prompt (``fill_len``, as a retracted
        request's), its sampler skips their draws (one per token: a seeded request draws on as
        it would have), and its grammar and penalties count them (synced from the output)."""
        if self.fatal_error is not None:
            raise TensorParallelError(self.fatal_error)
        vocab = self.runner.model_config.vocab_size
        bad = [t for t in (*prompt_ids, *output_ids) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {vocab})")
        if len(output_ids) >= params.max_tokens:
            raise ValueError(
                f"a resumed request has {len(output_ids)} output tokens, max_tokens "
                f"{params.max_tokens}: nothing is left to generate"
            )
        n = len(output_ids)
        req = Req(request_id, list(prompt_ids), params, namespace, output_ids=list(output_ids),
                  fill_len=len(prompt_ids) + n, num_resumed=n)  # fmt: skip
        self.scheduler.check_request(req)
        req.generator = make_generator(params, self._rng.randrange(2**31))
        skip_draws(req.generator, n)
        self.grammars.prepare(req)
        return req

    def step(
        self,
        before_run: BatchHook | None = None,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> StepResult:
        """Schedule, run and postprocess one batch. ``before_run(batch)`` is a role's look at
        the batch before its forward; what it returns, and ``on_layer_done`` (e.g. a node's
        heartbeat), are called with i as layer i's K/V of the new tokens is in the pool."""
        if self.fatal_error is not None:
            raise TensorParallelError(self.fatal_error)
        try:
            self.runner.check_ranks()  # a rank that exited: stop before taking work
        except TensorParallelError as e:
            self.fatal_error = str(e)
            raise
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
        except TensorParallelError as e:  # a rank is gone: this node cannot step again
            logger.error("%s: %s; the node stops", self.node_id, e)
            self.fatal_error = str(e)
            if self.staged:  # a cluster's node dies as one: the cluster re-routes the rest
                raise
            failed = self.scheduler.fail_batch(batch, f"forward failed: {e}")
            return StepResult([], failed, len(failed))
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
        """This engine's gauges and counters as the server reads them (``pd.engine.stats``); a
        node adds its transfer counters."""
        return stats_msg(
            self.node_id,
            role,
            self.scheduler,
            self.allocator,
            self.cache,
            PrefillCounters(self.num_prefill_tokens, self.prefill_seconds),
            transfer,
        )

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
