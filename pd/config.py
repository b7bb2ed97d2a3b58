"""Configuration: frozen dataclasses, validated in ``__post_init__``; CLI defaults come from here."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EngineConfig:
    """One model runner with its KV pool and scheduler limits (a node or the colocated engine)."""

    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct)
    device: str = "auto"  # auto: cuda if available, else cpu
    dtype: str = "auto"  # auto: float32 on cpu (exact HF parity), bfloat16 on cuda
    attention_backend: str = "auto"
    page_size: int = 1
    max_total_tokens: int = 32768  # KV slots in the pool
    max_running_requests: int = 64
    max_prefill_tokens: int = 2048  # token budget of one prefill batch (longer prompts are chunked)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_cache: bool = True
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    seed: int = 0

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_total_tokens < self.page_size:
            raise ValueError(
                f"max_total_tokens ({self.max_total_tokens}) must hold one page ({self.page_size})"
            )
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )

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
