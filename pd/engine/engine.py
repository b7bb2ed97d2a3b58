"""The colocated engine: one process that prefills and decodes with continuous batching.

It is the baseline the disaggregated cluster is compared with, and what ``pd generate`` and
``pd serve --colocated`` run. It owns an ``EngineCore`` (whose step is schedule -> run ->
postprocess) and turns its results into ``RequestOutput``s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from pd.cache.base import BasePrefixCache
from pd.core.kv_pool import SlotAllocator
from pd.core.messages import NodeStatsMsg
from pd.core.outputs import RequestOutput
from pd.core.request import Req
from pd.core.sampling_params import SamplingParams
from pd.engine.core import EngineCore
from pd.engine.scheduler import Scheduler
from pd.executor.config import EngineConfig
from pd.executor.runner import ModelRunner


class GenerateResult(NamedTuple):
    request_id: str
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int


class Engine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.core = EngineCore(cfg)
        self.cfg = cfg

    def close(self) -> None:
        """Stop the engine's other ranks, if it has any (tensor parallel), and its grammar
        compiler's worker."""
        self.core.runner.close()
        self.core.grammars.close()

    # The core's parts, for callers that inspect them (tests, benchmarks, the server's stats).
    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    @property
    def allocator(self) -> SlotAllocator:
        return self.core.allocator

    @property
    def cache(self) -> BasePrefixCache:
        return self.core.cache

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def has_unfinished(self) -> bool:
        return self.core.scheduler.num_unfinished > 0

    @property
    def has_runnable(self) -> bool:
        """An unfinished request that is not paused: a step may do something."""
        return self.core.scheduler.has_runnable

    def set_paused(self, request_id: str, is_paused: bool) -> None:
        """Leave the request out of steps, or take it back in (``Scheduler.set_paused``)."""
        self.core.scheduler.set_paused(request_id, is_paused)

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        namespace: str = "",
    ) -> str:
        """Queue a request; raises ValueError (nothing queued) if it can never run."""
        request_id = request_id if request_id is not None else self.core.new_request_id()
        self.core.scheduler.add(self.core.make_request(prompt_ids, params, request_id, namespace))
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.core.scheduler.abort(request_id)
        return None if req is None else _output(req)

    def step(self) -> list[RequestOutput]:
        """One step; with nothing to run while grammars compile, a short wait for one instead
        of a spin."""
        result = self.core.step()
        if result.num_scheduled == 0 and self.core.grammars.num_compiling:
            self.core.grammars.wait(0.01)
        return [_output(r) for r in result.produced + result.failed]

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[GenerateResult]:
        """Run prompts to completion (offline batch); results in prompt order. A request that
        fails raises RuntimeError with its error."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        done: dict[str, GenerateResult] = {}
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished:
            for out in self.step():
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                tokens[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    done[out.request_id] = GenerateResult(
                        out.request_id,
                        tokens[out.request_id],
                        out.finish_reason or "stop",
                        out.num_prompt_tokens,
                        out.num_cached_tokens,
                    )
        return [done[i] for i in ids]

    def warmup(self, prompts: Sequence[Sequence[int]]) -> None:
        """Prefill prompts so their prefixes stay cached (unpinned: evictable under pressure)."""
        self.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens of every admitted request so far."""
        return self.core.scheduler.stats().num_prompt_tokens

    @property
    def num_cached_tokens(self) -> int:
        """Of those, the tokens served from the prefix cache."""
        return self.core.scheduler.stats().num_cached_tokens

    def stats(self) -> NodeStatsMsg:
        return self.core.stats("colocated")

    def check_integrity(self) -> None:
        self.core.check_integrity()


def _output(req: Req) -> RequestOutput:
    new = req.take_new_outputs()
    return RequestOutput(
        req.request_id,
        new.token_ids,
        req.is_finished,
        req.finish_reason,
        req.num_prompt_tokens,
        req.num_cached_tokens,
        req.error,
        new.logprobs,
        req.is_refused,
    )
