"""The colocated engine: one process that prefills and decodes with continuous batching.

It is the baseline the disaggregated cluster is measured against, and what ``pd generate``
runs. Its step reads as three calls: ``schedule()`` -> ``run()`` -> ``postprocess()``.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from typing import NamedTuple

from pd.cache.base import BasePrefixCache, NoPrefixCache
from pd.config import EngineConfig
from pd.engine.kv_pool import SlotAllocator
from pd.engine.request import Req
from pd.engine.runner import ModelRunner
from pd.engine.sampler import make_generator
from pd.engine.scheduler import ScheduledBatch, Scheduler
from pd.model.tokenizer import eos_token_ids, load_tokenizer
from pd.outputs import RequestOutput
from pd.sampling_params import SamplingParams

CacheFactory = Callable[[SlotAllocator], BasePrefixCache]


class GenerateResult(NamedTuple):
    request_id: str
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int


class Engine:
    def __init__(
        self, cfg: EngineConfig, cache_factory: CacheFactory | None = None, role: str = "colocated"
    ) -> None:
        """``role`` is the scheduler's (see ``Scheduler``): prefill and decode nodes build their
        runner, pool, cache and scheduler through this class too, and drive them themselves."""
        self.cfg = cfg
        self.runner = ModelRunner(cfg)
        self.tokenizer = load_tokenizer(self.runner.model_dir)
        self.allocator = SlotAllocator(cfg.max_total_tokens, cfg.page_size)
        self.cache = (
            cache_factory(self.allocator) if cache_factory else NoPrefixCache(self.allocator)
        )
        self.scheduler = Scheduler(
            self.allocator,
            self.cache,
            max_running_requests=cfg.max_running_requests,
            max_prefill_tokens=cfg.max_prefill_tokens,
            max_model_len=self.runner.max_model_len,
            eos_token_ids=eos_token_ids(self.runner.model_dir, self.tokenizer),
            role=role,
        )
        self._ids = itertools.count()
        self._rng = random.Random(cfg.seed)  # seeds for requests that bring none

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        namespace: str = "",
    ) -> str:
        """Queue a request; raises ValueError (nothing queued) if it can never run."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        self.scheduler.add(self.make_request(prompt_ids, params, request_id, namespace))
        return request_id

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

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        return None if req is None else self._output(req)

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        tokens = self.run(batch)
        produced = self.scheduler.postprocess(batch, tokens)
        return [self._output(r) for r in produced]

    def run(self, batch: ScheduledBatch) -> list[int]:
        return self.runner.run(batch.reqs, batch.seqs)

    def _output(self, req: Req) -> RequestOutput:
        new = req.output_ids[len(req.output_ids) - req.num_new_outputs :]
        req.num_new_outputs = 0
        return RequestOutput(
            req.request_id,
            new,
            req.is_finished,
            req.finish_reason,
            req.num_prompt_tokens,
            req.num_cached,
        )

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[GenerateResult]:
        """Run prompts to completion (offline batch); results in prompt order."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        done: dict[str, GenerateResult] = {}
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished:
            for out in self.step():
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
        return self.scheduler.num_admitted_tokens

    @property
    def num_cached_tokens(self) -> int:
        """Of those, the tokens served from the prefix cache."""
        return self.scheduler.num_admitted_cached_tokens

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
