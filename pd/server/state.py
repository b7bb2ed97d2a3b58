"""``ServerState``: what every endpoint shares (``request.app.state.server``), on the event loop:
admission, the parse threads, the requests running on the engine, and shutdown.

What a parse thread checks of a request is ``checks`` (a ``pd.server.checks.RequestChecks``),
the only part of this state the ``prepare_*`` functions get.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import Response

from pd.core.backlog import Backlog
from pd.core.outputs import EngineClient
from pd.server.checks import Prepared, RequestChecks
from pd.server.config import ServerConfig
from pd.server.generation import Choices, Generation
from pd.server.http.admission import Admission, AdmissionTicket
from pd.server.http.errors import APIError, internal_error
from pd.server.http.stream_buffer import StreamBytes
from pd.server.http.streaming import ClientGone, DeadlineExceeded, cancel_on_disconnect
from pd.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T")

NOT_READY_RETRY_AFTER_S = 5


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
        self.checks = RequestChecks(tokenizer, model_name, max_model_len, config)
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.config = config
        self.admission = Admission(
            config.max_inflight_requests, config.max_queued_requests, metrics
        )
        # bytes held for slow readers by streams that gave their place back (stream_buffer)
        self.stream_bytes = StreamBytes(config.max_released_stream_bytes)
        self._parse_limiter = anyio.CapacityLimiter(config.num_parse_threads)
        self._is_shutting_down = False
        self._running: set[str] = set()  # ids of the requests running on the engine

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

    def new_choices(
        self, prefix: str, prep: Prepared, on_tokens: Callable[[int], None] | None = None
    ) -> Choices:
        """The request's ``prep.n`` choices: choice i seeded ``seed + i`` (vLLM's rule), its
        engine id the response's id with ``-i`` (one choice: the response's id itself). A
        stream's choices share one ``Backlog`` (``pd.core.backlog``): what waits for its client
        pauses it on the engine past ``max_stream_buffer_bytes``. (A non-streamed request is
        read as fast as the engine makes it: its answer is bounded by its max_tokens.)"""
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        cfg = self.config
        backlog = (
            Backlog(cfg.max_stream_buffer_bytes, cfg.stream_pause_timeout_s)
            if prep.stream
            else None
        )
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
                    backlog=backlog,
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
