"""``ServerState``: what every endpoint shares (``request.app.state.server``), and the checks
and steps common to them.

The ``check_*``/``encode``/``sampling_params`` methods run in a parse thread (they tokenize and
walk lists that a hostile body can make long); ``admit``, ``run`` and ``shut_down`` on the
event loop.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import Response

from pd.core.outputs import EngineClient
from pd.core.sampling_params import LogitBias, SamplingParams
from pd.model.tokenizer import encode_chat, encode_prompt
from pd.server.config import ServerConfig
from pd.server.generation import Choices, Generation
from pd.server.http.admission import Admission, AdmissionTicket
from pd.server.http.auth import cache_namespace
from pd.server.http.errors import APIError, internal_error
from pd.server.http.stream_buffer import StreamBytes
from pd.server.http.streaming import ClientGone, DeadlineExceeded, cancel_on_disconnect
from pd.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T")

NOT_READY_RETRY_AFTER_S = 5
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")


class Prepared(NamedTuple):
    """A request parsed, checked and tokenized: ready for the engine."""

    prompt_ids: list[int]
    params: SamplingParams
    namespace: str
    stream: bool
    include_usage: bool = False
    n: int = 1  # choices
    tools: Any = None  # chat: the tool calls to parse out of the answer (pd.server.openai.tools.Tools)


class ServerState:
    def __init__(
        self,
        client: EngineClient,
        tokenizer: Any,
        model_name: str,
        max_model_len: int,
        metrics: ServerMetrics,
        config: ServerConfig,
    ) -> None:
        assert max_model_len >= 2, f"max_model_len must be >= 2, got {max_model_len}"
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.config = config
        self._key_group = config.key_group()
        self.vocab_size = len(tokenizer)
        self.admission = Admission(
            config.max_inflight_requests, config.max_queued_requests, metrics
        )
        # bytes held for slow readers by streams that gave their place back (stream_buffer)
        self.stream_bytes = StreamBytes(config.max_released_stream_bytes)
        self._parse_limiter = anyio.CapacityLimiter(config.num_parse_threads)
        self._is_shutting_down = False
        self._running: set[str] = set()  # ids of the requests running on the engine
        self.key_priority = config.key_priorities()  # API key -> its requests' default priority
        # No token covers more characters than the longest one in the vocabulary, so a longer
        # text can never fit the context; refusing it spares its tokenization (seconds per MB).
        # Twice the bound, for tokenizers whose normalizer shortens text.
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = 2 * max_model_len * max(longest, 1)

    # -- on the event loop -------------------------------------------------------------------

    @property
    def is_shutting_down(self) -> bool:
        """SIGTERM came: new requests get 503 while those in flight finish (a readiness
        probe should fail from now on)."""
        return self._is_shutting_down

    async def shut_down(self, grace_s: float) -> bool:
        """Stop admitting; wait until no request holds or waits for a place and no stream
        still sends what its request generated, at most ``grace_s`` seconds. True: nothing
        was left in flight. Else the rest are cut: those waiting for a place get 503, those
        running are aborted on the engine (their answers end now, finish reason "abort")."""
        self._is_shutting_down = True
        with anyio.move_on_after(grace_s):
            await self.admission.wait_empty()
            await self.stream_bytes.wait_empty()  # streams done generating, still sending
        if self.admission.is_empty:
            return self.stream_bytes.num_streams == 0
        self.admission.close(self._shutting_down)
        for request_id in list(self._running):
            await self.client.abort(request_id)
        return False

    async def admit(
        self, request: Request, timeout_s: float, num_places: int = 1, priority: int = 0
    ) -> AdmissionTicket:
        """``num_places`` admission places (a request's choices), once the request's body is
        in, queued by ``priority``: 503 while the engine is not ready or the server shuts
        down, 400 when the server has fewer places, 429 when the queue is full, 504 past
        ``timeout_s``; ``ClientGone`` (counted) when the client disconnects while it waits."""
        if self._is_shutting_down:
            raise self._shutting_down()
        try:
            ready = bool(await self.client.is_ready())
        except Exception:
            logger.exception("is_ready() failed")
            ready = False
        if not ready:
            raise self._unavailable("not_ready", "engine_not_ready", "the engine is not ready")
        if (ticket := self.admission.try_admit(num_places)) is not None:
            return ticket
        waiting = self.admission.admit(timeout_s, num_places, priority)
        try:  # its own deadline bounds the wait
            return await cancel_on_disconnect(request, waiting, None)
        except ClientGone:
            self.metrics.client_gone.labels(where="queued").inc()
            raise

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` in a parse thread (a bounded pool)."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._parse_limiter)

    def priority_for(self, requested: int | None, api_key: str | None) -> int:
        """A request's priority: its own, else its API key's default, else 0."""
        if requested is not None:
            return requested
        return self.key_priority.get(api_key, 0) if api_key is not None else 0

    def new_choices(
        self, prefix: str, prep: Prepared, on_tokens: Callable[[int], None] | None = None
    ) -> Choices:
        """The request's ``prep.n`` choices: choice i seeded ``seed + i`` (vLLM's rule), its
        engine id the response's id with ``-i`` (one choice: the response's id itself)."""
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        gens = []
        for i in range(prep.n):
            params = prep.params
            if i and params.seed is not None:
                params = dataclasses.replace(params, seed=params.seed + i)
            gens.append(
                Generation(
                    client=self.client,
                    request_id=request_id if prep.n == 1 else f"{request_id}-{i}",
                    prompt_ids=prep.prompt_ids,
                    params=params,
                    tokenizer=self.tokenizer,
                    metrics=self.metrics,
                    namespace=prep.namespace,
                    running=self._running,
                    on_tokens=on_tokens,
                    count_prompt=i == 0,  # the prompt counts once against a key's tokens
                    tools=prep.tools,
                )
            )
        return Choices(request_id, gens)

    async def run(
        self, request: Request, gen: Generation | Choices, deadline: float
    ) -> Response | None:
        """Run a non-streaming request; a Response only when there is nothing to answer with."""
        try:
            await cancel_on_disconnect(request, gen.run(), deadline - time.monotonic())
        except ClientGone:
            self.metrics.client_gone.labels(where="running").inc()
            return Response(status_code=499)
        except DeadlineExceeded:
            raise self.timed_out() from None
        except ValueError as e:  # the engine refused the request (e.g. larger than its KV pool)
            raise APIError(str(e), status_code=400) from e
        except Exception as e:
            logger.exception("request %s failed", gen.request_id)
            raise internal_error(e) from e
        return None

    def _shutting_down(self) -> APIError:
        """The answer to a request the server will not run: it shuts down (counted; the
        connection closes, so that the client's next try goes elsewhere)."""
        return self._unavailable(
            "shutting_down", "server_shutting_down", "the server is shutting down", close=True
        )

    def _unavailable(self, reason: str, code: str, why: str, close: bool = False) -> APIError:
        """503 with Retry-After, counted under ``reason``."""
        self.metrics.rejected.labels(reason=reason).inc()
        headers = {"Retry-After": str(NOT_READY_RETRY_AFTER_S)}
        if close:
            headers["Connection"] = "close"
        return APIError(
            f"{why}; retry later",
            status_code=503,
            type="service_unavailable",
            code=code,
            headers=headers,
        )

    def timed_out(self) -> APIError:
        """The answer to a request past its deadline (counted)."""
        self.metrics.rejected.labels(reason="timeout").inc()
        return APIError(
            f"request timed out after {self.config.request_timeout:g} s (the server's "
            f"request_timeout)",
            status_code=504,
            type="timeout_error",
            code="request_timeout",
        )

    # -- in a parse thread -------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                status_code=404,
                param="model",
                code="model_not_found",
            )

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise APIError(
                f"token ids must be in [0, {self.vocab_size}), got {bad[:5]}", param=param
            )

    def prompt_ids(self, ids: Sequence[int], param: str) -> list[int]:
        self._check_fits(len(ids), param)
        self.check_ids(ids, param)
        return list(ids)

    def encode(self, text: str, param: str) -> list[int]:
        if not text:
            raise APIError(f"{param} must not be empty", param=param)
        self._check_chars(len(text), param)
        return encode_prompt(self.tokenizer, text)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
    ) -> list[int]:
        limit = self.config.max_messages
        if len(messages) > limit:
            raise APIError(f"{len(messages)} messages, at most {limit}", param="messages")
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        try:
            return encode_chat(self.tokenizer, messages, tools)
        except Exception as e:  # no template, or the template rejects the conversation
            raise APIError(f"cannot apply the chat template: {e}", param="messages") from e

    def max_tokens_for(self, num_prompt_tokens: int, requested: int | None, param: str) -> int:
        """The completion budget; 400 when the prompt and the request do not fit the context."""
        limit = self.max_model_len
        self._check_fits(num_prompt_tokens, param)
        if requested is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + requested > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, "
                f"{requested} for the completion). Reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    def sampling_params(
        self,
        fields: Mapping[str, Any],
        max_tokens: int,
        logit_bias: Mapping[str, float] | None,
        priority: int = 0,
    ) -> SamplingParams:
        """``fields``: a request's ``sampling_kwargs()``; checked against the server's limits.
        ``priority``: ``priority_for``'s."""
        cfg = self.config
        stop, stop_ids = fields["stop"], fields["stop_token_ids"]
        if len(stop) > cfg.max_stop_strings:
            raise APIError(
                f"{len(stop)} stop strings, at most {cfg.max_stop_strings}", param="stop"
            )
        longest = max((len(s) for s in stop), default=0)
        if longest > cfg.max_stop_string_chars:
            raise APIError(
                f"a stop string of {longest} characters, at most {cfg.max_stop_string_chars}",
                param="stop",
            )
        if len(stop_ids) > cfg.max_stop_token_ids:
            raise APIError(
                f"{len(stop_ids)} stop_token_ids, at most {cfg.max_stop_token_ids}",
                param="stop_token_ids",
            )
        self.check_ids(stop_ids, "stop_token_ids")
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                logit_bias=self._logit_bias(logit_bias),
                priority=priority,
                **fields,
            )
        except ValueError as e:
            raise APIError(str(e)) from e

    def namespace(self, api_key: str | None, cache_salt: str | None) -> str:
        """The cache namespace of a request of ``api_key``: its key group's or its own with
        isolation (the default), else the shared one (or the salt's)."""
        self._check_salt(cache_salt)
        if not self.config.isolate_cache_per_key or api_key is None:
            return cache_namespace(None, cache_salt)
        return cache_namespace(api_key, cache_salt, self._key_group.get(api_key))

    def group_namespace(self, group: str, cache_salt: str | None) -> str:
        """The namespace a request of key group ``group``'s keys gets (an admin's warmup)."""
        self._check_salt(cache_salt)
        groups = sorted(set(self._key_group.values()))
        if not self.config.isolate_cache_per_key or group not in groups:
            raise APIError(
                f"key_group {group!r} is not one of this server's {len(groups)} key groups"
                + ("" if self.config.isolate_cache_per_key else " (isolate_cache_per_key is off)"),
                param="key_group",
            )
        return cache_namespace(None, cache_salt, group)

    def _check_salt(self, cache_salt: str | None) -> None:
        limit = self.config.max_cache_salt_chars
        if cache_salt is not None and len(cache_salt) > limit:
            raise APIError(
                f"cache_salt has {len(cache_salt)} characters, at most {limit}", param="cache_salt"
            )

    def _logit_bias(self, bias: Mapping[str, float] | None) -> LogitBias:
        if not bias:
            return ()
        limit = self.config.max_logit_bias
        if len(bias) > limit:
            raise APIError(
                f"logit_bias has {len(bias)} tokens, at most {limit}", param="logit_bias"
            )
        pairs: dict[int, float] = {}
        for key, value in bias.items():
            token = int(key) if _TOKEN_ID_KEY.fullmatch(key) else -1
            if not 0 <= token < self.vocab_size:
                raise APIError(
                    f"logit_bias keys must be token ids in [0, {self.vocab_size}), got {key!r}",
                    param="logit_bias",
                )
            if token in pairs:
                raise APIError(f"logit_bias names token {token} twice", param="logit_bias")
            if not (math.isfinite(value) and -100.0 <= value <= 100.0):
                raise APIError(
                    f"logit_bias values must be in [-100, 100], got {value} for token {token}",
                    param="logit_bias",
                )
            pairs[token] = value
        return tuple(sorted(pairs.items()))

    def _check_fits(self, num_prompt_tokens: int, param: str) -> None:
        if num_prompt_tokens >= self.max_model_len:
            raise APIError(
                f"The prompt has {num_prompt_tokens} tokens, but this model's maximum context "
                f"length is {self.max_model_len} tokens and at least one must be left for the "
                f"completion.",
                param=param,
                code="context_length_exceeded",
            )

    def _check_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise APIError(
                f"The prompt has {num_chars} characters: more tokens than this model's maximum "
                f"context length of {self.max_model_len} tokens (no token of this tokenizer is "
                f"longer than {self.max_prompt_chars // (2 * self.max_model_len)} characters).",
                param=param,
                code="context_length_exceeded",
            )
