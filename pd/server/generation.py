"""One request's run on the engine: outputs in, text steps out.

``Generation`` (one sequence) drives ``EngineClient.generate``, detokenizes, applies stop
strings (aborting the engine side when one is hit), and records the sequence's metrics. Every
exit path that leaves the engine still working on it (stop string, client gone, error) aborts
it. ``Choices`` runs a request's ``n`` sequences (OpenAI's ``n``) and merges their steps. What
waits between the engine and the request's reader is bounded: a stream's outputs in the
engine's queues by its ``Backlog`` (``pd.core.backlog``: the engine pauses the request), the
merged steps by ``Choices`` (a step per choice).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import anyio

from pd.core.backlog import Backlog
from pd.core.messages import TokenLogprobsMsg
from pd.core.outputs import EngineClient, RequestOutput
from pd.core.sampling_params import SamplingParams
from pd.server.detokenizer import open_text_stream
from pd.server.metrics import ServerMetrics

# An abort that takes longer than this is given up on: the handler must not hang on a dead engine.
_ABORT_TIMEOUT_S = 5.0


class Step(NamedTuple):
    text: str  # text to emit (may be "" when the step only carries ids or the finish)
    token_ids: list[int]  # ids the engine produced in this step
    finish_reason: str | None  # set on the last step only
    logprobs: Sequence[TokenLogprobsMsg] = ()  # one per token id, when the request asked


@dataclass
class Generation:
    client: EngineClient
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tokenizer: Any
    metrics: ServerMetrics
    namespace: str = ""  # prefix-cache scope (pd.server.http.auth.cache_namespace)
    # the server's ids of running requests: this one is in it while it runs (a shutdown past
    # its grace aborts them)
    running: set[str] = field(default_factory=set)
    arrival: float = field(default_factory=time.perf_counter)
    num_cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobsMsg] = field(default_factory=list)  # when asked for
    text: str = ""
    finish_reason: str | None = None
    num_prompt_tokens: int = field(init=False)
    on_tokens: Callable[[int], None] | None = None  # told the prompt's tokens, then each output's
    count_prompt: bool = True  # False: on_tokens is told only the outputs (choices after the first)
    tools: Any = None  # chat: the calls to parse out of the answer (pd.server.openai.tools.Tools)
    backlog: Backlog | None = None  # a stream's: shared by its choices (EngineClient.generate)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_ids)

    async def steps(self) -> AsyncIterator[Step]:
        """Yield text steps until one with ``finish_reason``. Close it (``aclosing``) when
        stopping early: closing aborts the engine request."""
        stream = await open_text_stream(self.tokenizer, self.params, self.prompt_ids)
        engine_done = False
        first_token: float | None = None
        last_token: float | None = None
        outcome = "abort"
        outputs: AsyncIterator[RequestOutput] | None = None
        self.metrics.running.inc()
        self.running.add(self.request_id)
        if self.on_tokens is not None and self.count_prompt:
            self.on_tokens(self.num_prompt_tokens)
        try:
            outputs = self.client.generate(
                self.request_id,
                self.prompt_ids,
                self.params,
                namespace=self.namespace,
                backlog=self.backlog,
            )
            async for out in outputs:
                now = time.perf_counter()
                if out.new_token_ids:
                    if first_token is None:
                        first_token = now
                        self.metrics.record_first_token(self.arrival, now)
                    last_token = now
                delta, num_kept = stream.step_each(out.new_token_ids, out.finished)
                new_ids = out.new_token_ids[:num_kept]  # none past a stop string's last
                new_logprobs = list(out.logprobs[:num_kept])
                self._add(out, new_ids, new_logprobs)
                engine_done = out.finished
                self.text += delta.text
                if delta.stop_str is not None:
                    self.finish_reason = "stop"
                elif out.finished:
                    self.finish_reason = out.finish_reason or "stop"
                if self.finish_reason is not None:
                    outcome = self.finish_reason
                    yield Step(delta.text, new_ids, self.finish_reason, new_logprobs)
                    return
                if delta.text or new_ids:
                    yield Step(delta.text, new_ids, None, new_logprobs)
            outcome = "error"
            raise RuntimeError(
                f"engine stream of {self.request_id} ended without a finished output"
            )
        except Exception:
            outcome = "error"
            raise
        finally:
            # Shielded: a cancelled stream (client gone) must still reach the engine.
            with anyio.move_on_after(_ABORT_TIMEOUT_S, shield=True):
                aclose = getattr(outputs, "aclose", None)
                if aclose is not None:
                    await aclose()
                if not engine_done:
                    await self.client.abort(self.request_id)
            self.metrics.running.dec()
            self.running.discard(self.request_id)
            self.metrics.record_finished(
                finish_reason=outcome,
                num_prompt_tokens=self.num_prompt_tokens,
                num_cached_tokens=self.num_cached_tokens,
                num_output_tokens=len(self.output_ids),
                arrival=self.arrival,
                first_token=first_token,
                last_token=last_token,
                finished=time.perf_counter(),
            )

    def _add(
        self, out: RequestOutput, new_ids: Sequence[int], logprobs: Sequence[TokenLogprobsMsg]
    ) -> None:
        assert out.request_id == self.request_id, (out.request_id, self.request_id)
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.output_ids.extend(new_ids)
        self.output_logprobs.extend(logprobs)
        if self.on_tokens is not None:
            self.on_tokens(len(new_ids))

    async def run(self) -> str:
        """Run to the end; return the finish reason."""
        async for _ in self.steps():
            pass
        assert self.finish_reason is not None
        return self.finish_reason


class Choices:
    """The ``n`` choices of one request: one ``Generation`` each, of the same prompt, decoded
    as separate rows (choice i samples with ``seed + i`` when seeded: vLLM's rule).

    1. Choice 0 starts alone. The engine puts a prompt into its prefix cache at its first token
       (on the cluster, the prefill node's cache), so once choice 0's first step is out the
       others start and match the prompt there: its KV is held once (the cache's page-aligned
       part; only the last partial page is computed again per choice), never copied.
    2. ``steps`` merges the choices' steps as they come, each with its choice's index: a
       choice waits while a step of each is queued, so its engine stream is read only as the
       request's reader takes them (and the engine pauses it: ``Generation.backlog``).
    3. Closing ``steps`` (or a choice failing) cancels every choice, which aborts it on the
       engine (``Generation.steps``).
    """

    def __init__(self, request_id: str, gens: Sequence[Generation]) -> None:
        assert gens, "a request has at least one choice"
        self.request_id = request_id  # the response's id
        self.gens = list(gens)
        self.params = gens[0].params
        self.tokenizer = gens[0].tokenizer

    @property
    def num_prompt_tokens(self) -> int:
        return self.gens[0].num_prompt_tokens

    @property
    def num_cached_tokens(self) -> int:
        """The first choice's: the prompt is counted once (the others find it cached)."""
        return self.gens[0].num_cached_tokens

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(g.output_ids) for g in self.gens)

    async def steps(self) -> AsyncIterator[tuple[int, Step]]:
        """(choice index, step) until every choice has had its finishing step. Close it
        (``aclosing``) when stopping early."""
        if len(self.gens) == 1:
            async with aclosing(self.gens[0].steps()) as steps:
                async for step in steps:
                    yield 0, step
            return
        queue: asyncio.Queue[tuple[int, Step | Exception | None]] = asyncio.Queue(
            maxsize=len(self.gens)
        )

        async def pump(i: int) -> None:
            try:
                async with aclosing(self.gens[i].steps()) as steps:
                    async for step in steps:
                        await queue.put((i, step))
            except Exception as e:  # handed to the reader, which fails the request
                await queue.put((i, e))
                return
            await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(0))]
        try:
            num_done = 0
            while num_done < len(self.gens):
                i, item = await queue.get()
                if item is None:
                    num_done += 1
                    continue
                if isinstance(item, Exception):
                    raise item
                if len(tasks) == 1:  # choice 0's first step: its prompt is cached now
                    tasks += [asyncio.ensure_future(pump(j)) for j in range(1, len(self.gens))]
                yield i, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run(self) -> None:
        """Run every choice to its end."""
        async with aclosing(self.steps()) as steps:
            async for _ in steps:
                pass
        assert all(g.finish_reason is not None for g in self.gens)
