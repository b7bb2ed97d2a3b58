"""A request's state inside one engine or node (plain Python)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pd.core.sampling_params import SamplingParams


@dataclass(eq=False)
class Req:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    namespace: str = ""
    output_ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # KV slots of the tokens computed so far
    num_cached_tokens: int = 0  # leading prompt tokens served from a prefix cache
    cache_node: Any = None  # the prefix-cache node this request holds a lock on
    finish_reason: str | None = None
    error: str | None = None  # why the request failed here (finish_reason is then "abort")
    generator: Any = None  # torch.Generator for sampled requests; opaque to schedulers
    num_new_outputs: int = 0  # outputs not yet reported to the caller
    fill_len: int = 0  # tokens to compute before sampling: the prompt, or all ids on a resume
    num_admissions: int = 0  # > 1: the request was retracted and resumed

    def __post_init__(self) -> None:
        self.fill_len = self.fill_len or len(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_computed(self) -> int:
        return len(self.slots)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.fill_len

    @property
    def max_len(self) -> int:
        """Tokens this request may ever hold KV for (the last sampled token needs none)."""
        return len(self.prompt_ids) + self.params.max_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def fail(self, error: str) -> None:
        self.finish_reason, self.error = "abort", error
