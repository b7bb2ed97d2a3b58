"""Configuration: frozen dataclasses, validated in ``__post_init__``; CLI defaults come from here."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from pd.cache.tenants import TenantShares
from pd.core import envs
from pd.core.kv_pool import KV_SCALE_BYTES
from pd.core.options import option
from pd.executor.graphs import parse_buckets
from pd.model.quant import INT4_GROUP_SIZE, check_quantization, resolve_linear_backend

AUTO_CPU_BUCKETS = (1, 2, 4)  # ``compile_buckets="auto"`` on a CPU
DEFAULT_KV_TOKENS = 32768  # a pool's default bytes: this many tokens of KV in the model's dtype
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")


@dataclass(frozen=True)
class EngineConfig:
    """One model runner with its KV pool and scheduler limits (a node or the colocated engine)."""

    model: str | None = option(
        None, "HF checkpoint dir or .gguf file; default: SmolLM2-135M-Instruct"
    )
    device: str = option("auto", "cpu, cuda, cuda:N; auto: cuda if available")
    dtype: str = option(
        "auto", "float32 | bfloat16 | float16; auto: float32 on cpu, bfloat16 on cuda"
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV as stored in the pools, tiers and transfers: auto (the model's dtype) | int8 (cpu: "
        "int8 codes and an fp32 scale per token and head, about 2-4x the tokens in the same "
        "bytes, the same answer alone or batched, cold or warm) | fp8, fp8_e4m3 (reserved for "
        "a CUDA kernel pd does not have yet: refused)",
        choices=KV_CACHE_DTYPES,
    )
    quantization: str = option(
        "none",
        "weight-only cpu formats: none | int8 | int4 | fp16 (pd/model/quant.py); auto: int4 for "
        "a float32 model on a cpu, else none (pd serve's default)",
    )
    linear_backend: str = option(
        "auto",
        "matmuls of unquantized weights with --no-deterministic: onednn (cpu, packed once at "
        "load) | aten (torch's default GEMM); auto: onednn where it runs (pd/model/quant.py)",
    )
    attention_backend: str = option(
        "auto",
        "auto: pd's C++ kernel on a cpu (pd/executor/cpu_attention.py), SDPA elsewhere | torch: "
        "torch's ops alone (not with --deterministic)",
    )
    compile_buckets: str = option(
        "off",
        "decode batch sizes with a compiled step (torch.compile at start-up, tens of seconds a "
        "size on a cpu), e.g. 1,2,4,8; off: eager; auto: 1,2,4 on a cpu (pd serve's default)",
    )
    compile_cache: str = option(
        "auto",
        "where compiled decode steps are kept (keyed by pd's code, torch, the model, the flags "
        "and the cpu), so a restart loads them in seconds: auto (PD_CACHE_DIR/compiled) | a "
        "directory | off (compile at every start)",
    )
    deterministic: bool = option(
        True,
        "the same answer whatever the batch and the cache hold: pd's own kernels (on a cpu; "
        "README); --no-deterministic: library matmuls, answers may change with load",
    )
    speculative_tokens: int = option(
        0,
        "n-gram speculative decoding: up to this many tokens a step guessed from the prefix "
        "cache or the request's own text, checked in the same forward (lossless); 0: off",
    )
    speculative_max_batch: int = option(
        4, "speculate only in decode steps of at most this many requests (past it, it costs)"
    )
    max_grammar_chars: int = option(
        1 << 18,
        "a request's grammar (structured outputs, tools) longer than this is refused with a "
        "400 before it compiles (twice the server's limit on a schema's JSON)",
    )
    grammar_timeout_s: float = option(
        5.0,
        "a grammar that takes longer to compile (on a worker thread, never the loop's) is "
        "refused with a 400",
    )
    page_size: int = option(1, "tokens per KV page (1: token-level prefix reuse)")
    max_total_tokens: int | None = option(
        None,
        f"KV slots in each pool; default: what {DEFAULT_KV_TOKENS} tokens of KV in the model's "
        "dtype take, in slots of --kv-cache-dtype (int8: 2-4x as many)",
    )
    max_running_requests: int = option(64, "requests in one running batch")
    max_prefill_tokens: int = option(
        2048, "token budget of a prefill batch; longer prompts are chunked"
    )
    max_mixed_prefill_tokens: int = option(
        512, "prefill tokens a step may run beside decoding requests (smaller keeps their TPOT)"
    )
    new_token_ratio: float = option(
        0.7,
        "admission expects a request to decode this fraction of its max_tokens, or of 512 "
        "tokens or as many as it decoded already if fewer (decaying while nothing is "
        "retracted); 1.0: the worst case of max_tokens up to 512, never retracted",
    )
    max_model_len: int | None = option(None, "context length; default: the model's")
    enable_prefix_cache: bool = option(True, "RadixCache prefix reuse")
    host_cache_tokens: int | None = option(
        None,
        "KV slots of the host tier below each pool (what it evicts); default: 4 x the "
        "pool's slots, at most 1/8 of the node's share of the machine's memory (physical, "
        "or the cgroup's limit where lower, over the nodes that may share the machine); 0: off",
    )
    disk_cache_dir: str | None = option(
        None,
        "a disk tier below the host tier, shared by the nodes of one host (a node started "
        "later reads it up); made 0700, refused if another user could write it; default: none",
    )
    disk_cache_gb: float = option(
        16.0, "the disk tier directory's bound, GiB, for every node and model sharing it"
    )
    disk_cache_min_free_gb: float = option(
        1.0,
        "the disk tier writes only while its file system keeps this many GiB free, and "
        "--disk-cache-min-free-percent of itself (the larger); below that it removes its "
        "oldest chunks or holds writes back until there is room; 0 and 0: no floor",
    )
    disk_cache_min_free_percent: float = option(
        5.0, "the disk tier's file system's free-space floor, percent of its size"
    )
    cache_eviction: str = option(
        "fair",
        "fair: under pressure, the tenant (API key group) holding most of a cache tier per "
        "unit of its share loses its own least recent prefixes first; lru: one global "
        "least-recently-used order",
    )
    cache_share: tuple[str, ...] = option(
        (),
        "GROUP=WEIGHT: a key group's weight in fair eviction (repeatable; default 1 each, a "
        "key outside any group too)",
    )
    num_threads: int | None = option(
        None,
        "torch threads per process (per node in a cluster); default: torch's, or in a cluster "
        "on the CPU the machine's cores split over the larger pool's nodes",
    )
    seed: int = option(0, "seed for requests that bring none")
    tensor_parallel_size: int = option(
        1,
        "ranks of each node (tensor parallel: a process and a device each; on a cpu the "
        "node's threads split over them); the model's heads must split evenly",
        aliases=("--tp",),
    )
    tensor_parallel_timeout_s: float = option(
        30.0, "seconds a rank waits for another in a step before the node stops as one"
    )

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(
                f"max_total_tokens ({self.max_total_tokens}) must hold one page ({self.page_size})"
            )
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.max_mixed_prefill_tokens < 1:
            raise ValueError(
                f"max_mixed_prefill_tokens must be >= 1, got {self.max_mixed_prefill_tokens}"
            )
        if not 0.0 < self.new_token_ratio <= 1.0:
            raise ValueError(f"new_token_ratio must be in (0, 1], got {self.new_token_ratio}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.host_cache_tokens is not None and not (
            self.host_cache_tokens == 0 or self.host_cache_tokens >= self.page_size
        ):
            raise ValueError(
                f"host_cache_tokens must be 0 (off) or hold one page ({self.page_size}), "
                f"got {self.host_cache_tokens}"
            )
        if self.disk_cache_dir is not None and (
            self.host_cache_tokens == 0 or not self.enable_prefix_cache
        ):
            raise ValueError("disk_cache_dir needs the prefix cache and its host tier")
        if not self.disk_cache_gb > 0:
            raise ValueError(f"disk_cache_gb must be > 0, got {self.disk_cache_gb}")
        if not self.disk_cache_min_free_gb >= 0:
            raise ValueError(
                f"disk_cache_min_free_gb must be >= 0, got {self.disk_cache_min_free_gb}"
            )
        if not 0 <= self.disk_cache_min_free_percent < 100:
            raise ValueError(
                "disk_cache_min_free_percent must be in [0, 100), got "
                f"{self.disk_cache_min_free_percent}"
            )
        if self.cache_eviction not in ("fair", "lru"):
            raise ValueError(f"cache_eviction must be fair or lru, got {self.cache_eviction!r}")
        object.__setattr__(self, "cache_share", tuple(self.cache_share or ()))  # flag unset: None
        self.cache_shares()  # raises on a malformed GROUP=WEIGHT
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.attention_backend not in ("auto", "torch"):
            raise ValueError(
                f"attention_backend must be auto or torch, got {self.attention_backend!r}"
            )
        self.buckets  # noqa: B018 (parses the spec: a bad one raises here)
        self._check_kv_cache_dtype()
        if self.speculative_tokens < 0 or self.speculative_max_batch < 1:
            raise ValueError(
                f"speculative_tokens must be >= 0 and speculative_max_batch >= 1, got "
                f"{self.speculative_tokens} and {self.speculative_max_batch}"
            )
        if self.quantization != "auto":
            check_quantization(self.quantization, self.torch_device)
        resolve_linear_backend(self.linear_backend, self.torch_device, self.torch_dtype)
        if self.max_grammar_chars < 1 or not self.grammar_timeout_s > 0:
            raise ValueError(
                f"max_grammar_chars must be >= 1 and grammar_timeout_s > 0, got "
                f"{self.max_grammar_chars} and {self.grammar_timeout_s}"
            )
        if self.tensor_parallel_size < 1 or not self.tensor_parallel_timeout_s > 0:
            raise ValueError(
                f"tensor_parallel_size must be >= 1 and tensor_parallel_timeout_s > 0, got "
                f"{self.tensor_parallel_size} and {self.tensor_parallel_timeout_s}"
            )

    def _check_kv_cache_dtype(self) -> None:
        """Raise, saying why, for a KV dtype this build cannot hold or read."""
        kv = self.kv_cache_dtype
        if kv not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv!r}")
        if kv.startswith("fp8"):
            raise ValueError(
                f"kv_cache_dtype {kv} is reserved for a CUDA attention kernel that pd does not "
                "have yet, and a cpu has no fp8 arithmetic: use int8 (cpu) or auto"
            )
        if kv == "int8" and self.torch_device.type != "cpu":
            raise ValueError(
                f"kv_cache_dtype int8 is read by pd's C++ attention kernel, which runs on a cpu; "
                f"device is {self.torch_device}: use auto"
            )
        if kv == "int8" and self.attention_backend != "auto":
            raise ValueError(
                "kv_cache_dtype int8 is read by pd's C++ attention kernel (attention backend "
                f"auto), not by {self.attention_backend!r}"
            )

    def pool_slots(self, head_dim: int) -> int:
        """The KV slots of each pool of a model of ``head_dim``: ``max_total_tokens`` as set,
        else the bytes of ``DEFAULT_KV_TOKENS`` tokens of KV in the model's dtype, in slots of
        ``kv_cache_dtype`` (an int8 row of a head takes ``head_dim + KV_SCALE_BYTES`` bytes: 3.8x
        fp32's slots at head dim 64, 1.9x bf16's)."""
        if self.max_total_tokens is not None:
            return self.max_total_tokens
        if self.kv_cache_dtype != "int8":
            return DEFAULT_KV_TOKENS
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return DEFAULT_KV_TOKENS * head_dim * elem // (head_dim + KV_SCALE_BYTES)

    def cache_shares(self) -> TenantShares | None:
        """The tenants' weights for fair eviction; None: global LRU."""
        if self.cache_eviction == "lru":
            return None
        return TenantShares.parse(self.cache_share)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def quantization_method(self, in_features: Iterable[int] = ()) -> str:
        """``quantization`` with ``auto`` resolved for this process's device and a model whose
        linears take ``in_features``: int4 (the fastest format that passes BENCHMARKS.md's
        quality check) where the model would run in fp32 on a CPU whose torch has the kernel
        and every layer fits its groups; else none (a chosen ``dtype`` is kept as it is)."""
        if self.quantization != "auto":
            return self.quantization
        if self.torch_dtype != torch.float32:
            return "none"
        try:
            check_quantization("int4", self.torch_device)
        except ValueError:
            return "none"
        return "int4" if all(k % INT4_GROUP_SIZE == 0 for k in in_features) else "none"

    @property
    def compile_cache_dir(self) -> Path | None:
        """``compile_cache`` resolved: the directory of kept compiled steps, or None (off)."""
        spec = self.compile_cache.strip()
        if spec.lower() in ("", "off", "none"):
            return None
        return envs.PD_CACHE_DIR / "compiled" if spec.lower() == "auto" else Path(spec).expanduser()

    @property
    def buckets(self) -> tuple[int, ...]:
        """``compile_buckets`` parsed, with ``auto`` resolved for this process's device: 1, 2
        and 4 on a CPU (BENCHMARKS.md, "Compiled decode steps"), none elsewhere (the GPU's
        graphs are not built)."""
        if self.compile_buckets.strip().lower() == "auto":
            return AUTO_CPU_BUCKETS if self.torch_device.type == "cpu" else ()
        return parse_buckets(self.compile_buckets)
