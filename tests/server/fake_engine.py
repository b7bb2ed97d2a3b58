"""A deterministic ``EngineClient`` for server tests: it replays a fixed token script."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from pd.core.backlog import Backlog
from pd.core.outputs import RequestOutput
from pd.core.sampling_params import SamplingParams


class FakeEngineClient:
    """Replays ``output_ids`` ``tokens_per_step`` at a time, ``delay_s`` apart; honours
    max_tokens ("length"), stop_token_ids / eos ("stop"); running out of script is "stop"; an
    abort while it is read ends it with an empty output, finish reason "abort" (as the real
    engines do). Records every request, abort, cancellation and normal finish, and the loop it
    runs on."""

    def __init__(
        self,
        output_ids: Sequence[int],
        *,
        eos_token_id: int | None = None,
        tokens_per_step: int = 1,
        delay_s: float = 0.0,
        num_cached_tokens: int = 0,
        ready: bool = True,
        fail_after: int | None = None,
    ) -> None:
        assert tokens_per_step >= 1
        self.output_ids = list(output_ids)
        self.eos_token_id = eos_token_id
        self.tokens_per_step = tokens_per_step
        self.delay_s = delay_s
        self.num_cached_tokens = num_cached_tokens
        self.ready = ready
        self.fail_after = fail_after  # raise after this many outputs (an engine crash)
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.namespaces: list[str] = []
        self.aborted: list[str] = []
        self.cancelled: list[str] = []
        self.finished: list[str] = []
        self.loop: asyncio.AbstractEventLoop | None = None

    async def is_ready(self) -> bool:
        return self.ready

    async def readiness(self) -> str | None:
        return None if self.ready else "the fake engine is not ready"

    async def abort(self, request_id: str) -> None:
        await asyncio.sleep(0.001)  # a real abort goes over a socket: it suspends
        self.aborted.append(request_id)

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        namespace: str = "",
        backlog: Backlog | None = None,  # nothing waits here: it makes an output when read
    ) -> AsyncIterator[RequestOutput]:
        self.requests.append((request_id, list(prompt_ids), params))
        self.loop = asyncio.get_running_loop()
        self.namespaces.append(namespace)
        num_cached = min(self.num_cached_tokens, len(prompt_ids))
        pos = 0
        num_outputs = 0
        try:
            while True:
                step: list[int] = []
                reason = None
                while len(step) < self.tokens_per_step and reason is None:
                    if pos == len(self.output_ids):
                        reason = "stop"
                        break
                    token = self.output_ids[pos]
                    pos += 1
                    step.append(token)
                    is_eos = token == self.eos_token_id and not params.ignore_eos
                    if is_eos or token in params.stop_token_ids:
                        reason = "stop"
                    elif pos >= params.max_tokens:
                        reason = "length"
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if request_id in self.aborted:
                    yield RequestOutput(request_id, [], True, "abort", len(prompt_ids), num_cached)
                    return
                if self.fail_after is not None and num_outputs >= self.fail_after:
                    raise RuntimeError("fake engine crashed")
                num_outputs += 1
                if reason is not None:  # before the yield: the consumer may close us right after
                    self.finished.append(request_id)
                yield RequestOutput(
                    request_id, step, reason is not None, reason, len(prompt_ids), num_cached
                )
                if reason is not None:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            if request_id not in self.finished:
                self.cancelled.append(request_id)
            raise
