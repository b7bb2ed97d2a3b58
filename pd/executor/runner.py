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

from pd.core import envs
from pd.core.batch import ForwardBatch, SeqInput
from pd.core.kv_pool import KVPool
from pd.core.request import Req
from pd.executor import cpu_attention
from pd.executor.attention import make_attention_backend
from pd.executor.config import EngineConfig
from pd.executor.grammar import Guide, allocate_masks, make_tokenizer
from pd.executor.graphs import DecodeGraphs
from pd.executor.host_pool import HostKVPool, host_tier_slots
from pd.executor.penalties import TokenCounts
from pd.executor.sampler import SampledRow, sample
from pd.executor.spec import verify_row
from pd.model import fixed_ops
from pd.model.config import ModelConfig
from pd.model.decoder import DecoderLM
from pd.model.loader import load_config, load_weights, resolve_model
from pd.model.quant import (
    DEQUANT_MIN_TOKENS,
    check_deterministic,
    dense_dtype,
    quantize_linears,
    resolve_linear_backend,
)
from pd.model.sharding import TensorParallel, kv_heads_of, shard_config
from pd.model.tokenizer import eos_token_ids, load_tokenizer
from pd.parallel.group import RankProcesses, TPGroup, threads_per_rank
from pd.parallel.rank_kv import RankKV, ShardedHostKVPool, StagingPool

logger = logging.getLogger(__name__)


class ModelRunner:
    """The node's model, or with ``tensor_parallel_size`` N > 1 rank ``rank``'s shard of it
    (``pd.parallel.group``): rank 0 starts ranks 1..N-1 and sends each of them every
    batch it runs; a rank >= 1 (``store_dir``: where rank 0's group rendezvouses) runs what it
    is sent and computes no logits."""

    def __init__(
        self,
        cfg: EngineConfig,
        rank: int = 0,
        store_dir: str | None = None,
        machine_nodes: int = 1,
        staged: bool = False,
    ) -> None:
        self.tp_size = cfg.tensor_parallel_size
        threads = (
            threads_per_rank(cfg) if self.tp_size > 1 else cfg.num_threads or envs.PD_NUM_THREADS
        )
        if threads:
            torch.set_num_threads(threads)
        self.cfg = cfg
        self.rank = rank
        self.machine_nodes = machine_nodes  # nodes sharing this machine's memory (host tier)
        self.device = cfg.torch_device
        if self.device.type == "cuda" and self.tp_size > 1:
            self.device = torch.device("cuda", (self.device.index or 0) + rank)
        self.dtype = cfg.torch_dtype
        self.model_dir = resolve_model(cfg.model)
        self.model_config = ModelConfig.from_hf(load_config(self.model_dir))  # the whole model's
        mc = self.model_config
        self.shard_config = shard_config(mc, self.tp_size, rank)  # this rank's heads, columns
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
        sc = self.shard_config
        self.deterministic = self._check_deterministic()
        self.ranks: RankProcesses | None = None
        self.group: TPGroup | None = None
        if self.tp_size > 1:
            if rank == 0:  # the ranks load their shards while this one loads its own
                self.ranks = RankProcesses(cfg, machine_nodes)
                self.ranks.start()
                store_dir = self.ranks.store_dir
            assert store_dir is not None, "a rank >= 1 joins rank 0's group"
            self.group = TPGroup(
                rank,
                self.tp_size,
                store_dir,
                self.device,
                cfg.tensor_parallel_timeout_s,
                self.deterministic,
            )
        self.model = self._load_model()
        self.pool = KVPool(
            sc.num_layers,
            cfg.max_total_tokens + 1,  # + the scratch slot
            sc.num_kv_heads,
            sc.head_dim,
            self.dtype,
            self.device,
        )
        self.attn = make_attention_backend(
            cfg.attention_backend,
            self.device,
            self.extend_attention_dtype,
            DEQUANT_MIN_TOKENS,
            every_row_on_kernel=self.deterministic,
            specs=mc.attention_specs(),
        )
        self.graphs = DecodeGraphs(
            self.model,
            self.pool,
            cfg.buckets,
            cfg.max_total_tokens,
            kernel=cfg.attention_backend == "auto",
            head=rank == 0,
        )
        self.graphs.compile()
        # a tensor-parallel node's KV copies, and (rank 0 of a node in a cluster, ``staged``)
        # the pool of every head the transfer plane moves KV through
        self.rank_kv: RankKV | None = None
        self.staging: StagingPool | None = None
        if self.group is not None:
            plans = self.ranks.plans if self.ranks is not None else None
            self.rank_kv = RankKV(self.pool, None, self.group, plans, mc.num_kv_heads)
            if staged and rank == 0:
                self.staging = StagingPool(self.rank_kv)

    @property
    def transfer_pool(self) -> KVPool:
        """The pool the transfer plane sends from and receives into: this one, or on a
        tensor-parallel node its staging pool of every head."""
        return self.staging.pool if self.staging is not None else self.pool

    @property
    def has_head(self) -> bool:
        """Whether this runner computes logits (rank 0; the others only their shard's part)."""
        return self.rank == 0

    def make_host_pool(self) -> HostKVPool | ShardedHostKVPool | None:
        """The host tier's pool beside this runner's (None: no tier): on a tensor-parallel
        node each rank's holds its shard, and rank 0's orders the others' copies. Every rank
        sizes it alike, by the node's bytes per token (all its ranks' shards together)."""
        kv, size = self.model_config.num_kv_heads, self.tp_size
        node_heads = sum(len(kv_heads_of(kv, r, size)) for r in range(size))
        node_bytes = self.pool.num_bytes_per_token // self.shard_config.num_kv_heads * node_heads
        num_host = host_tier_slots(self.cfg, node_bytes, self.machine_nodes)
        if not num_host:
            return None
        local = HostKVPool(self.pool, num_host)
        if self.rank_kv is None:
            return local
        self.rank_kv.host = local
        return ShardedHostKVPool(self.rank_kv, self.staging)

    def check_ranks(self) -> None:
        """Raise ``TensorParallelError`` if a rank of this node has exited."""
        if self.ranks is not None:
            self.ranks.check()

    def close(self) -> None:
        """Stop the node's other ranks (rank 0) and leave the group."""
        if self.ranks is not None:
            self.ranks.stop()
            self.ranks = None
        if self.group is not None:
            self.group.close()
            self.group = None

    @functools.cached_property
    def grammar_tokenizer(self) -> Any:
        """llguidance's tokenizer (``pd.executor.grammar``), built when a guided request first
        needs it: seconds, which an engine that never sees a grammar never spends."""
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
        if self.group is not None:
            tp = TensorParallel(self.rank, self.tp_size, self.group.reduce)
        with torch.device("meta"):  # no memory, no init: the checkpoint's tensors replace them
            model = DecoderLM(mc, tp)
        model.load_weights(load_weights(self.model_dir, self.dtype, self.device))
        backend = resolve_linear_backend(self.cfg.linear_backend, self.device, self.dtype)
        if self.deterministic:
            model.use_fixed_ops()
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
        if self.ranks is not None and self.ranks.plans is not None:
            self.ranks.plans.forward(seqs, return_all_logits)  # the ranks run it beside us
        if self.staging is None:
            return self._forward(seqs, return_all_logits, on_layer_done)
        # a TP node in a cluster: what the ranks' layers wrote reaches the staging pool (and
        # each layer's hook, e.g. the transfer's send) once the whole forward is done
        logits = self._forward(seqs, return_all_logits, None)
        self.staging.mirror([t for s in seqs for t in s.slots[s.num_prefix :]])
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
        """Forward one scheduled batch and sample each request's next token (``banned``: per
        request, ids it must not sample; a request with a grammar samples only what it allows).

        ``drafts[i]`` (for the first len(drafts) requests, decoding ones): tokens guessed to
        follow request i, which then has 1 + len(drafts[i]) one-token rows in ``seqs`` (its
        last token, then each draft token); its row is ``spec.verify``'s verdict on them (on the
        draft's prefix its grammar accepts)."""
        logits = self.forward(seqs, on_layer_done=on_layer_done)
        vocab = logits.shape[-1]
        counts = [TokenCounts.of(r, vocab) for r in reqs]  # None: no penalties
        guides, failed = self._guides(reqs)
        if not any(drafts):
            params, gens = [r.params for r in reqs], [r.generator for r in reqs]
            masks = self._masks(guides, vocab)
            return _with_failed(sample(logits, params, gens, banned, counts, masks), failed)
        verdicts: dict[int, SampledRow] = {}
        plain: list[int] = []  # the requests sampled as usual ...
        last_rows: list[int] = []  # ... and the logits row of each
        row = 0
        for i, req in enumerate(reqs):
            draft = drafts[i] if i < len(drafts) else ()
            guide = guides[i]
            if draft and guide is not None:
                draft_masks = allocate_masks(len(draft) + 1, vocab)
                kept = guide.fill_draft(draft, draft_masks, 0)
                rows = logits[row : row + len(kept) + 1]
                verdicts[i] = verify_row(
                    rows, kept, req.params, req.generator, counts[i], draft_masks[: len(kept) + 1]
                )
            elif draft:
                rows = logits[row : row + len(draft) + 1]
                verdicts[i] = verify_row(rows, draft, req.params, req.generator, counts[i])
            else:
                plain.append(i)
                last_rows.append(row)
            row += len(draft) + 1
        sampled = iter(
            sample(
                logits[last_rows],
                [reqs[i].params for i in plain],
                [reqs[i].generator for i in plain],
                [banned[i] for i in plain] if banned else (),
                [counts[i] for i in plain],
                self._masks([guides[i] for i in plain], vocab),
            )
        )
        rows_out = [verdicts[i] if i in verdicts else next(sampled) for i in range(len(reqs))]
        return _with_failed(rows_out, failed)

    def _guides(self, reqs: Sequence[Req]) -> tuple[list[Guide | None], dict[int, str]]:
        """Each request's grammar guide, up to date with its output (None: no grammar), and the
        requests whose grammar failed (it does not compile here, or the output broke it)."""
        guides: list[Guide | None] = []
        failed: dict[int, str] = {}
        for i, req in enumerate(reqs):
            try:
                guides.append(Guide.of(req, lambda: self.grammar_tokenizer))
            except ValueError as e:
                guides.append(None)
                failed[i] = str(e)
        return guides, failed

    @staticmethod
    def _masks(guides: Sequence[Guide | None], vocab: int) -> list[torch.Tensor | None]:
        """Each guided row's bitmask of the tokens its grammar allows next (None elsewhere)."""
        if all(g is None for g in guides):
            return []
        masks = allocate_masks(len(guides), vocab)
        for r, guide in enumerate(guides):
            if guide is not None:
                guide.fill(masks, r)
        return [masks[r] if g is not None else None for r, g in enumerate(guides)]


def _with_failed(rows: list[SampledRow], failed: dict[int, str]) -> list[SampledRow]:
    """``rows`` with the rows of the requests whose grammar failed replaced by their error."""
    for i, error in failed.items():
        rows[i] = SampledRow(-1, error)
    return rows
