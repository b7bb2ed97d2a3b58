"""Compiled decode steps: one ``torch.compile`` graph per batch-size bucket (what CUDA graphs
are to a GPU server, for the CPU).

An eager decode step runs ~45 small torch ops per layer, each paying its dispatch every step,
however few tokens it computes. Here the whole decode forward (embedding, every
layer with its KV write and its attention over the paged pool, the final norm and the LM head)
is traced once per bucket with static shapes and compiled by inductor (C++ loops on the CPU;
with ``--no-deterministic`` the weights are frozen into the graph, so library matmuls use packed
weights). A batch of B decode rows
runs in the smallest bucket >= B, padded with rows that write and read only the pool's scratch
slot. The key length is the one dynamic dimension: the attention takes the keys by an index
tensor (``PagedDecodeAttention``), so a longer context reuses the graph instead of recompiling.
On the CPU, in bf16 and fp32, that attention is one call of ``pd.executor.cpu_attention``'s C++
kernel inside the graph (faster than inductor's own fused loops: docs/bench/history.md,
"Compiled decode steps"); otherwise inductor compiles ``attention.paged_decode_attention``.

A deterministic runner (``EngineConfig.deterministic``) gives the graph nothing to rewrite:
the norms, the rotary embedding and the gated SiLU are ``pd.model.fixed_ops``' opaque
operators and the linears (the LM head too) and attention are pd's kernels, so a compiled step
gives each row the bits an eager forward gives it (inductor's fused loops round otherwise).

Prefill, mixed batches, and decode batches above the largest bucket run eagerly. A bucket that
fails to compile (say, no C++ compiler) is logged and left eager. With ``--no-deterministic``
the fp16 LM head of the quantized formats is fbgemm's packed object, which the tracer cannot
enter: it runs eagerly after the graph. A speculative step's draft rows are one-token rows too (``pd.engine.drafter``), so a
verify runs in the graph of its row count.

Each bucket compiles at start-up (``DecodeGraphs.compile``; tens of seconds a bucket for
SmolLM2 on 2 cores) and the seconds are kept per bucket (``compile_seconds``). A deterministic
runner's steps (one whole graph, weights read as inputs) are compiled ahead of their first call
and kept on disk (``pd.executor.compile_cache``): a later start with the same code, model and
flags loads them (``loaded``) instead of compiling.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from pd.core.batch import DecodeBatch, SeqInput
from pd.core.kv_pool import KVPool
from pd.core.private_dir import InsecurePathError
from pd.executor import cpu_attention
from pd.executor.attention import PagedDecodeAttention
from pd.executor.compile_cache import CompiledStepCache
from pd.model.decoder import DecoderLM, MoE
from pd.model.quant import Fp16Linear

logger = logging.getLogger(__name__)

_MAX_ENTRIES = 1024  # compiled graphs of ``DecodeGraphs._forward`` in one process


def parse_buckets(spec: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> (1, 2, 4); ``""`` or ``"off"`` -> () (no compiled steps)."""
    if spec.strip().lower() in ("", "off", "none"):
        return ()
    try:
        sizes = sorted({int(part) for part in spec.split(",") if part.strip()})
    except ValueError:
        raise ValueError(
            f"compile buckets must be batch sizes like 1,2,4,8 or off, got {spec!r}"
        ) from None
    if not sizes or sizes[0] < 1:
        raise ValueError(f"compile buckets must be batch sizes >= 1, got {spec!r}")
    return tuple(sizes)


class DecodeGraphs:
    """The compiled decode steps of one model and pool, one per bucket."""

    def __init__(
        self,
        model: DecoderLM,
        pool: KVPool,
        buckets: Sequence[int],
        scratch_slot: int,
        kernel: bool = True,
        head: bool = True,
        freeze: bool = True,
        cache: CompiledStepCache | None = None,
    ) -> None:
        if not 0 <= scratch_slot < pool.num_slots:
            raise ValueError(f"scratch slot {scratch_slot} outside the pool ({pool.num_slots})")
        self.model = model
        self.pool = pool
        self.buckets = tuple(sorted(buckets))
        self.scratch_slot = scratch_slot
        cfg = model.config
        # kernel: attention by pd's C++ kernel where it runs (an opaque call in the graph)
        self.attn = PagedDecodeAttention(
            kernel=kernel
            and cpu_attention.available(
                pool.compute_dtype, pool.device, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
            ),
            specs=cfg.attention_specs(),
        )
        if pool.is_quantized and not self.attn.kernel:  # the traced torch ops read no codes
            raise ValueError("an int8 KV pool's decode steps need pd's C++ attention kernel")
        # fp16 weights are packed in an object the tracer cannot enter: such a head (every
        # quantized format has one) runs eagerly after the graph
        self.head_in_graph = head and not isinstance(model.lm_head, Fp16Linear)
        self.has_head = head  # False: a tensor-parallel rank >= 1, whose steps end at the norm
        self.compile_seconds: dict[int, float] = {}  # bucket -> seconds, for each compiled one
        self.num_runs: dict[int, int] = {}  # bucket -> decode steps it has run
        self.enabled = True  # False: every step eager (benchmarks compare the two)
        if cache is not None and (freeze or model.has_moe):
            raise ValueError("only a whole graph without frozen weights is kept on disk")
        self.freeze = freeze
        self.cache = cache  # where the steps are kept (pd.executor.compile_cache), or None
        self.loaded: set[int] = set()  # buckets whose steps were read from ``cache``
        self.num_eager_fallbacks = 0  # steps a saved graph's guards refused (run eagerly)
        self._steps: dict[int, Callable[[DecodeBatch], torch.Tensor]] = {}
        self._marked: set[int] = set()  # buckets of torch.compile: their batches marked

    def compile(self) -> dict[int, float]:
        """Compile every bucket, or load it from ``cache`` (each run once on padding rows
        alone); -> the seconds each took. A bucket that fails stays eager."""
        for bucket in self.buckets:
            t0 = time.perf_counter()
            try:
                if self.cache is None:
                    step = self._compile(bucket)
                else:
                    # inference mode: a loaded step's guards expect the dispatch keys it had
                    with self.cache.inductor_dir(), torch.inference_mode():
                        step = self._load(bucket) or self._precompile(bucket)
            except InsecurePathError:
                raise  # an operator's error (pd.core.private_dir), not a failed compile
            except Exception:
                logger.exception("compiling the decode step of bucket %d failed: eager", bucket)
                continue
            self._steps[bucket] = step
            self.compile_seconds[bucket] = time.perf_counter() - t0
            logger.info(
                "decode step for batches up to %d %s in %.1f s",
                bucket,
                "loaded" if bucket in self.loaded else "compiled",
                self.compile_seconds[bucket],
            )
        return dict(self.compile_seconds)

    @contextmanager
    def _compiling(self) -> Iterator[None]:
        # Every bucket of every engine in the process is one more entry of ``_forward``'s code
        # object; the entries are made here and only looked up afterwards. Each is static but
        # for the key length: without automatic dynamic shapes, an entry made after another
        # engine's (other dims) does not turn those dims symbolic, which inductor miscompiled
        # around pd's opaque ops (an undefined stride). emulate_precision_casts: a bf16 value
        # fused into the next op is rounded to bf16 first, as eager rounds it (else a fused
        # residual add skips a rounding). freezing: the weights become constants of the graph
        # (packed for the library matmuls of --no-deterministic); a step that is kept on disk
        # reads them as inputs (torch cannot save a frozen graph), and its matmuls are pd's.
        with (
            torch._inductor.config.patch(freezing=self.freeze, emulate_precision_casts=True),
            torch._dynamo.config.patch(
                recompile_limit=_MAX_ENTRIES, automatic_dynamic_shapes=False
            ),
            torch.inference_mode(),
        ):
            yield

    def _compile(self, bucket: int) -> Callable[[DecodeBatch], torch.Tensor]:
        """``bucket``'s step by ``torch.compile``, in this process's memory alone."""
        # a mixture of experts routes by data: its blocks run eagerly between the graphs
        for module in self.model.modules():
            if isinstance(module, MoE) and "forward" not in vars(module):
                module.forward = torch.compiler.disable(module.forward)
        step = torch.compile(self._forward, fullgraph=not self.model.has_moe, dynamic=None)
        self._marked.add(bucket)
        with self._compiling():
            step(self._batch([], bucket, num_keys=2))
        return step

    def _precompile(self, bucket: int) -> Callable[[DecodeBatch], torch.Tensor]:
        """``bucket``'s step compiled ahead of its first call, then kept in ``cache``."""
        assert self.cache is not None
        with self._compiling():
            example = self._batch([], bucket, num_keys=2, mark=True)
            fn = torch.compile(self._traced, fullgraph=True, dynamic=None).aot_compile(
                (self._inputs(example), {})
            )
        self.cache.save(bucket, fn)
        step = _SavedStep(fn, self)
        with torch.inference_mode():
            step(self._batch([], bucket, num_keys=2))
        return step

    def _load(self, bucket: int) -> Callable[[DecodeBatch], torch.Tensor] | None:
        """``bucket``'s step from ``cache``, run once; None if absent or unusable (removed)."""
        assert self.cache is not None
        fn = self.cache.load(bucket)
        if fn is None:
            return None
        step = _SavedStep(fn, self)
        try:
            with torch.inference_mode():
                warm = self._batch([], bucket, num_keys=2)
                if not fn.guard_check(*self._inputs(warm)):
                    f_locals = fn.prepare_f_locals(*self._inputs(warm))
                    why = fn._artifacts.guard_manager.check_verbose(f_locals).verbose_code_parts
                    raise ValueError(f"its guards refuse this engine's batch: {why}")
                step(warm)
        except Exception as e:
            self.cache.reject(bucket, f"{type(e).__name__}: {e}")
            return None
        self.loaded.add(bucket)
        return step

    def bucket_for(self, seqs: Sequence[SeqInput]) -> int | None:
        """The compiled bucket that runs ``seqs``, or None if they must run eagerly (not all
        one-token decodes, or more rows than any compiled bucket)."""
        if (
            not self._steps
            or not self.enabled
            or not all(len(s.new_token_ids) == 1 and s.num_prefix >= 1 for s in seqs)
        ):
            return None  # the first token of a prompt attends to itself alone: a prefill
        return next((b for b in self._steps if b >= len(seqs)), None)

    def run(self, seqs: Sequence[SeqInput], bucket: int) -> torch.Tensor:
        """Logits ``[len(seqs), vocab]`` of one decode step in ``bucket``'s graph."""
        self.num_runs[bucket] = self.num_runs.get(bucket, 0) + 1
        with torch.inference_mode():  # the batch's tensors too: the graph was traced so
            out = self._steps[bucket](self._batch(seqs, bucket))[: len(seqs)]
            return out if self.head_in_graph or not self.has_head else self.model.logits(out)

    def _batch(
        self, seqs: Sequence[SeqInput], bucket: int, num_keys: int = 0, mark: bool = False
    ) -> DecodeBatch:
        if seqs:
            batch = DecodeBatch.build(seqs, bucket, self.scratch_slot, self.pool.device)
        else:  # warm-up: padding rows alone, num_keys keys each
            pad = [SeqInput([0], [self.scratch_slot] * num_keys, num_keys - 1)]
            batch = DecodeBatch.build(pad * bucket, bucket, self.scratch_slot, self.pool.device)
        if not (mark or bucket in self._marked):  # a saved step's guards refuse marks
            return batch
        # the key length varies (not a recompile); the bucket's rows never do
        for t in (batch.input_ids, batch.positions, batch.out_slots, batch.kv_idx, batch.kv_mask):
            torch._dynamo.mark_static(t, 0)
        torch._dynamo.mark_dynamic(batch.kv_idx, 1)
        torch._dynamo.mark_dynamic(batch.kv_mask, 1)
        return batch

    @property
    def _traced(self) -> Callable[..., torch.Tensor]:
        return _logits_step if self.head_in_graph else _hidden_step

    def _inputs(self, batch: DecodeBatch) -> tuple[Any, ...]:
        return self.model, self.pool, self.attn, batch

    def _forward(self, batch: DecodeBatch) -> torch.Tensor:
        run = self.model.compute if self.head_in_graph else self.model.hidden
        return run(batch, self.pool, self.attn)  # type: ignore[arg-type]


def _logits_step(
    model: DecoderLM, pool: KVPool, attn: PagedDecodeAttention, batch: DecodeBatch
) -> torch.Tensor:
    """What a kept step traces: a plain function of what it runs on (so a step loaded in another
    process runs on that one's model and pool)."""
    return model.compute(batch, pool, attn)  # type: ignore[arg-type]


def _hidden_step(
    model: DecoderLM, pool: KVPool, attn: PagedDecodeAttention, batch: DecodeBatch
) -> torch.Tensor:
    """``_logits_step`` ending at the final norm (the head runs after it, or on another rank)."""
    return model.hidden(batch, pool, attn)  # type: ignore[arg-type]


class _SavedStep:
    """A precompiled step (``torch.compile(...).aot_compile``), run where its guards accept the
    batch; elsewhere eagerly (counted: the same bits, since a kept step is deterministic)."""

    def __init__(self, fn: Any, graphs: DecodeGraphs) -> None:
        self.fn = fn
        self.graphs = graphs

    def __call__(self, batch: DecodeBatch) -> torch.Tensor:
        inputs = self.graphs._inputs(batch)
        if self.fn.guard_check(*inputs):
            return self.fn.fn(*inputs)
        self.graphs.num_eager_fallbacks += 1
        return self.graphs._forward(batch)
