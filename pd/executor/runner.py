"""``ModelRunner``: the model, its KV pool and attention backend — the only part that touches
tensors. Schedulers hand it plain-Python ``SeqInput`` lists and get token ids back.

A decode-only batch that a compiled bucket covers runs in that bucket's graph
(``pd.executor.graphs``); everything else runs eagerly. The pool has one slot more than the
allocator hands out: the compiled steps' scratch slot for padding rows."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pd.cache.host_tier import BaseKVMover
from pd.core import envs
from pd.core.attention import BaseAttentionBackend
from pd.core.batch import ForwardBatch, SeqInput
from pd.core.kv_pool import KVPool
from pd.core.request import Req
from pd.executor import cpu_attention
from pd.executor.attention import make_attention_backend
from pd.executor.batch_sampler import BatchSampler
from pd.executor.compile_cache import CompiledStepCache
from pd.executor.config import EngineConfig
from pd.executor.grammar import make_tokenizer
from pd.executor.graphs import DecodeGraphs
from pd.executor.host_pool import HostKVPool, host_tier_slots
from pd.executor.rank_link import BaseRankLink
from pd.executor.sampler import SampledRow
from pd.model import fixed_ops
from pd.model.config import ModelConfig
from pd.model.decoder import DecoderLM
from pd.model.loader import load_config, load_weights, resolve_model, weights_digest
from pd.model.quant import (
    DEQUANT_MIN_TOKENS,
    check_deterministic,
    dense_dtype,
    quantize_linears,
    resolve_linear_backend,
)
from pd.model.sharding import TensorParallel, kv_heads_of, shard_config
from pd.model.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)


class ModelRunner:
    """The node's model, or on a tensor-parallel node (``ranks``: this rank's link to the
    others, ``pd.parallel.ranks.RankLink``) rank ``ranks.rank``'s shard of it: rank 0 sends the
    others every batch it runs; a rank >= 1 runs what it is sent and computes no logits."""

    def __init__(
        self, cfg: EngineConfig, machine_nodes: int = 1, ranks: BaseRankLink | None = None
    ) -> None:
        if cfg.tensor_parallel_size > 1 and ranks is None:
            raise ValueError(
                f"a runner of {cfg.tensor_parallel_size} ranks needs its link to the others "
                "(pd.parallel.ranks.RankLink)"
            )
        self.tp_size = cfg.tensor_parallel_size
        threads = _num_threads(cfg)
        if threads:
            torch.set_num_threads(threads)
        self.cfg = cfg
        self.ranks = ranks
        self.rank = ranks.rank if ranks is not None else 0
        self.machine_nodes = machine_nodes  # nodes sharing this machine's memory (host tier)
        self._resolve_configs()
        self.deterministic = self._check_deterministic()
        if ranks is not None:  # rank 0 starts the others, which load while it loads
            ranks.join(self.device, self.deterministic)
        self.model = self._load_model()
        self.pool, self.attn = self._build_pool()
        self.graphs = self._build_graphs()
        if ranks is not None:  # the KV copies between ranks, over this rank's pool
            ranks.attach(self.pool, self.model_config.num_kv_heads)
        self.sampler = BatchSampler()

    def _resolve_configs(self) -> None:
        """The device and dtype, the model (whole, and this rank's shard), the longest
        sequence, and the weight format (``auto`` resolved)."""
        cfg = self.cfg
        self.device = cfg.torch_device
        if self.device.type == "cuda" and self.tp_size > 1:
            self.device = torch.device("cuda", (self.device.index or 0) + self.rank)
        self.dtype = cfg.torch_dtype
        self.model_dir = resolve_model(cfg.model)
        self.model_config = ModelConfig.from_hf(load_config(self.model_dir))  # the whole model's
        mc = self.model_config
        self.shard_config = shard_config(mc, self.tp_size, self.rank)  # this rank's heads
        self.max_model_len = min(
            cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        # the weight format, ``auto`` resolved: what the weights are packed as (the same on
        # every rank: the linears' inputs of each rank's shard)
        shards = [shard_config(mc, self.tp_size, r) for r in range(self.tp_size)]
        self.quantization = cfg.quantization_method(
            {mc.hidden_size}
            | {s.num_heads * s.head_dim for s in shards}
            | {s.intermediate_size for s in shards}
        )

    @property
    def num_slots(self) -> int:
        """The slots the allocator hands out (``EngineConfig.pool_slots``; the pool has one
        more, the compiled steps' scratch slot)."""
        return self.cfg.pool_slots(self.model_config.head_dim)

    def _build_pool(self) -> tuple[KVPool, BaseAttentionBackend]:
        """This rank's KV pool and the attention backend that reads it (int8 KV: every row
        on pd's C++ kernel, the one reader of its codes)."""
        sc, cfg = self.shard_config, self.cfg
        int8 = cfg.kv_cache_dtype == "int8"
        heads = (sc.num_heads, sc.num_kv_heads, sc.head_dim)
        if int8 and not cpu_attention.available(self.dtype, self.device, *heads):
            raise ValueError(
                f"kv_cache_dtype int8 is read by pd's C++ attention kernel, which does not run "
                f"here ({self.dtype} on {self.device}, heads {heads}, or no C++ compiler): use auto"
            )
        pool = KVPool(
            sc.num_layers,
            self.num_slots + 1,  # + the scratch slot
            sc.num_kv_heads,
            sc.head_dim,
            self.dtype,
            self.device,
            quantize=cpu_attention.quantize if int8 else None,
        )
        attn = make_attention_backend(
            cfg.attention_backend,
            self.device,
            self.extend_attention_dtype,
            DEQUANT_MIN_TOKENS,
            every_row_on_kernel=self.deterministic or int8,
            specs=self.model_config.attention_specs(),
        )
        return pool, attn

    def _build_graphs(self) -> DecodeGraphs:
        """The compiled decode steps, one per bucket (``pd.executor.graphs``)."""
        graphs = DecodeGraphs(
            self.model,
            self.pool,
            self.cfg.buckets,
            self.num_slots,
            kernel=self.cfg.attention_backend == "auto",
            head=self.rank == 0,
            freeze=not self.deterministic,
            cache=self._step_cache(),
        )
        graphs.compile()
        return graphs

    def _step_cache(self) -> CompiledStepCache | None:
        """Where the compiled steps are kept on disk (``pd.executor.compile_cache``), keyed by
        what shapes them here: None without buckets, with ``compile_cache`` off, or where a
        step freezes its weights (``--no-deterministic``), routes by data (a mixture of
        experts) or holds a tensor-parallel process group (its guards keep the group's store),
        which torch cannot save: those steps are compiled at each start."""
        cfg = self.cfg
        root = cfg.compile_cache_dir
        if root is None or not (cfg.buckets and self.deterministic) or self.model.has_moe:
            return None
        if self.tp_size > 1:  # (a rank's step calls its group's all-reduce)
            return None
        pool = self.pool
        identity = {
            "weights": weights_digest(self.model_dir),
            "modules": repr(self.model),  # the layers' formats and shapes
            "flags": repr((cfg.dtype, self.quantization, cfg.linear_backend,
                           cfg.attention_backend, cfg.kv_cache_dtype, self.deterministic)),
            "pool": repr((pool.num_layers, pool.num_slots, pool.num_kv_heads, pool.head_dim,
                          pool.dtype, pool.compute_dtype, str(pool.device))),
        }  # fmt: skip
        return CompiledStepCache(identity, root)

    @property
    def transfer_pool(self) -> KVPool:
        """The pool the transfer plane sends from and receives into: this one, or on a
        tensor-parallel node its staging pool of every head."""
        staging = self.ranks.staging_pool if self.ranks is not None else None
        return staging if staging is not None else self.pool

    @property
    def has_head(self) -> bool:
        """Whether this runner computes logits (rank 0; the others only their shard's part)."""
        return self.rank == 0

    def make_host_pool(self) -> BaseKVMover | None:
        """The host tier's pool beside this runner's (None: no tier): on a tensor-parallel
        node each rank's holds its shard, and rank 0's orders the others' copies. Every rank
        sizes it alike, by the node's bytes per token (all its ranks' shards together)."""
        kv, size = self.model_config.num_kv_heads, self.tp_size
        node_heads = sum(len(kv_heads_of(kv, r, size)) for r in range(size))
        node_bytes = self.pool.num_bytes_per_token // self.shard_config.num_kv_heads * node_heads
        num_host = host_tier_slots(self.cfg, node_bytes, self.machine_nodes, self.num_slots)
        if not num_host:
            return None
        local = HostKVPool(self.pool, num_host)
        return local if self.ranks is None else self.ranks.host_pool(local)

    def check_ranks(self) -> None:
        """Raise ``TensorParallelError`` if a rank of this node has exited."""
        if self.ranks is not None:
            self.ranks.check()

    def close(self) -> None:
        """Stop the node's other ranks (rank 0) and leave the group."""
        if self.ranks is not None:
            self.ranks.close()

    @functools.cached_property
    def grammar_tokenizer(self) -> Any:
        """llguidance's tokenizer (``pd.executor.grammar``), built on the compiler's worker
        when a grammar is first compiled (seconds, which an engine that never sees a grammar
        never spends), or at a node's start (``GrammarCompiler.warm``)."""
        tokenizer = load_tokenizer(self.model_dir)
        return make_tokenizer(
            tokenizer, self.model_config.vocab_size, eos_token_ids(self.model_dir)
        )

    @property
    def extend_attention_dtype(self) -> torch.dtype | None:
        """The dtype long prefill chunks attend in, if not the model's (never when
        deterministic): bf16 for int4 and int8 weights in an fp32 model on a CPU with oneDNN's
        bf16 path, whose linears multiply bf16 weights by bf16 activations from
        ``DEQUANT_MIN_TOKENS`` new tokens on (bf16 SDPA is faster there, slower on an AVX2-only
        CPU: BENCHMARKS.md, "OpenMP threads that share the cores, and int4's prefill
        attention")."""
        quantized = self.quantization in ("int4", "int8")
        if self.deterministic:
            return None
        if quantized and self.dtype == torch.float32 and self.device.type == "cpu":
            return torch.bfloat16 if dense_dtype() == torch.bfloat16 else None
        return None

    def _check_deterministic(self) -> bool:
        """Whether this runner computes deterministically (``EngineConfig.deterministic``: on
        the CPU, where pd's kernels make it so); raise, saying what to change, where it was
        asked for and a setting rules it out."""
        if not self.cfg.deterministic:
            return False
        if self.device.type != "cpu":
            logger.warning(
                "deterministic inference runs on the cpu only: on %s an answer may depend on "
                "its batch and on the cache's history",
                self.device,
            )
            return False
        mc = self.shard_config
        heads = (mc.num_heads, mc.num_kv_heads, mc.head_dim)
        kernels = cpu_attention.available(self.dtype, self.device, *heads) and fixed_ops.available()
        if self.cfg.attention_backend != "auto" or not kernels:
            raise ValueError(
                f"deterministic inference runs on pd's C++ kernels (attention backend auto, bf16 "
                f"or fp32 weights, a C++ compiler); have attention backend "
                f"{self.cfg.attention_backend!r}, {self.dtype}, kernels built: {kernels}; pass "
                "--no-deterministic"
            )
        check_deterministic(self.quantization)
        return True

    def _load_model(self) -> DecoderLM:
        mc = self.model_config
        tp = None
        if self.ranks is not None:
            tp = TensorParallel(self.rank, self.tp_size, self.ranks.reduce)
        with torch.device("meta"):  # no memory, no init: the checkpoint's tensors replace them
            model = DecoderLM(mc, tp)
        model.load_weights(load_weights(self.model_dir, self.dtype, self.device))
        # the linear backend is the library path's (--no-deterministic); pd's matmuls need none
        backend = "aten"
        if self.deterministic:
            model.use_fixed_ops()
        else:
            backend = resolve_linear_backend(self.cfg.linear_backend, self.device, self.dtype)
        return quantize_linears(
            model.to(self.dtype).eval(),
            self.quantization,
            linear_backend=backend,
            deterministic=self.deterministic,
        )

    def forward(
        self,
        seqs: Sequence[SeqInput],
        *,
        return_all_logits: bool = False,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run one batch; logits [R, vocab] (or [T, vocab] with return_all_logits); on a rank
        >= 1, the final norm's output instead (it has no head)."""
        if self.ranks is not None:
            self.ranks.send_forward(seqs, return_all_logits)  # the ranks run it beside us
        if self.ranks is None or self.ranks.staging_pool is None:
            return self._forward(seqs, return_all_logits, on_layer_done)
        # a TP node in a cluster: what the ranks' layers wrote reaches the staging pool (and
        # each layer's hook, e.g. the transfer's send) once the whole forward is done
        logits = self._forward(seqs, return_all_logits, None)
        self.ranks.mirror([t for s in seqs for t in s.slots[s.num_prefix :]])
        if on_layer_done is not None:
            for layer in range(self.model_config.num_layers):
                on_layer_done(layer)
        return logits

    def _forward(
        self,
        seqs: Sequence[SeqInput],
        return_all_logits: bool,
        on_layer_done: Callable[[int], None] | None,
    ) -> torch.Tensor:
        bucket = None if return_all_logits else self.graphs.bucket_for(seqs)
        if bucket is not None:
            logits = self.graphs.run(seqs, bucket)
            if on_layer_done is not None:  # the graph has written every layer's K/V
                for layer in range(self.model_config.num_layers):
                    on_layer_done(layer)
            return logits
        batch = ForwardBatch.build(seqs, self.device, return_all_logits=return_all_logits)
        batch.on_layer_done = on_layer_done
        if not self.has_head:
            with torch.inference_mode():
                return self.model.hidden(batch, self.pool, self.attn)
        return self.model(batch, self.pool, self.attn)

    def run(
        self,
        reqs: Sequence[Req],
        seqs: Sequence[SeqInput],
        on_layer_done: Callable[[int], None] | None = None,
        banned: Sequence[frozenset[int]] = (),
        drafts: Sequence[Sequence[int]] = (),
    ) -> list[SampledRow]:
        """Forward one scheduled batch and sample each request's next token
        (``BatchSampler.sample``: ``banned`` ids, grammars, penalties, ``drafts``)."""
        logits = self.forward(seqs, on_layer_done=on_layer_done)
        return self.sampler.sample(logits, reqs, banned, drafts)


def _num_threads(cfg: EngineConfig) -> int | None:
    """This runner's torch threads (None: torch's default); on the CPU a tensor-parallel
    node's cores split over its ranks."""
    threads = cfg.num_threads or envs.PD_NUM_THREADS
    if cfg.tensor_parallel_size == 1 or cfg.torch_device.type != "cpu":
        return threads
    return max(1, (threads or torch.get_num_threads()) // cfg.tensor_parallel_size)
