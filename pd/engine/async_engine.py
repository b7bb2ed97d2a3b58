"""``AsyncEngine``: the colocated engine behind the ``EngineClient`` interface.

The engine is built and steps on its own thread (torch releases the GIL in its kernels, so the
HTTP event loop stays responsive); requests and aborts reach it through a queue, outputs come
back to each request's asyncio queue. A stream's outputs count in its ``Backlog`` while they
wait there (``pd.core.backlog``): past its high mark the engine leaves the request out of its
steps until the caller catches up, and ends it (``ReaderStalled``) if it does not in time.

Built on that thread, not handed over (``pd.engine.torch_thread``: one OpenMP team per process).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from pd.core.backlog import Backlog, Flow, ReaderStalled
from pd.core.messages import NodeStatsMsg, token_bytes
from pd.core.outputs import RequestOutput
from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.engine.torch_thread import TorchThread
from pd.parallel.group import TensorParallelError

logger = logging.getLogger(__name__)

_STATS_INTERVAL_S = 0.2


class AsyncEngine:
    def __init__(self, build: Callable[[], Engine]) -> None:
        """Build the engine with ``build()`` on the engine thread, which then steps it; what
        ``build`` raises is raised here."""
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        # by request id: its loop and what puts an output (or error) in its queue there
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, Callable[[Any], None]]] = {}
        self._stopped = threading.Event()
        self._next_stats = 0.0
        self._thread = TorchThread("pd-engine")
        self.engine = self._thread.run(build)
        self._stats = self.engine.stats()
        self._thread.start(self._loop)

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        namespace: str = "",
        backlog: Backlog | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        out_q: asyncio.Queue[Any] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        num_queued = 0  # bytes of out_q's outputs (in ``backlog``)

        def put(item: Any) -> None:  # on the event loop
            nonlocal num_queued
            out_q.put_nowait(item)
            if backlog is not None and isinstance(item, RequestOutput):
                num_queued += _num_bytes(item)
                backlog.add(_num_bytes(item))

        def on_flow(flow: Flow) -> None:
            if flow is Flow.STALLED:
                self._streams.pop(request_id, None)  # nothing more comes: the error is last
                self._inbox.put(("abort", request_id))
                assert backlog is not None
                why = (
                    f"request {request_id}: its client did not catch up with its answer within "
                    f"{backlog.max_pause_s:g} s: ended"
                )
                out_q.put_nowait(ReaderStalled(why))
            else:
                self._inbox.put(("pause", (request_id, flow is Flow.PAUSE)))

        self._streams[request_id] = (loop, put)
        if backlog is not None:
            backlog.watch(on_flow)
        self._inbox.put(("add", (request_id, prompt_ids, params, namespace)))
        finished = False
        try:
            while not finished:
                item = await out_q.get()
                if isinstance(item, BaseException):
                    raise item
                if backlog is not None:
                    num_queued -= _num_bytes(item)
                    backlog.take(_num_bytes(item))
                finished = item.finished
                yield item
        finally:
            if not finished:  # cancelled (client gone) or failed: free the request's slots
                self._inbox.put(("abort", request_id))
            self._streams.pop(request_id, None)
            if backlog is not None:
                backlog.unwatch(on_flow)
                backlog.take(num_queued)

    async def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    async def is_ready(self) -> bool:
        return self._thread.is_alive() and self.engine.core.fatal_error is None

    async def readiness(self) -> str | None:
        if not self._thread.is_alive():
            return "the engine thread is not running"
        return self.engine.core.fatal_error  # a rank of a tensor-parallel engine gone

    def stats(self) -> NodeStatsMsg:
        """The engine's stats, as of its last step (refreshed a few times a second)."""
        return self._stats

    def shutdown(self) -> None:
        self._stopped.set()
        self._inbox.put(("stop", None))
        self._thread.join(timeout=10)
        self.engine.close()  # a tensor-parallel engine's ranks (they would die with the thread)

    def call(self, fn: Any) -> Any:
        """Run ``fn(engine)`` on the engine thread and return its result (for stats, checks)."""
        done: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._inbox.put(("call", (fn, done)))
        result = done.get(timeout=60)
        if isinstance(result, BaseException):
            raise result
        return result

    # -- engine thread ----------------------------------------------------------------------

    def _deliver(self, request_id: str, item: Any) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, put = stream
            loop.call_soon_threadsafe(put, item)

    def _handle(self, cmd: str, arg: Any) -> None:
        if cmd == "add":
            request_id, prompt_ids, params, namespace = arg
            try:
                self.engine.add_request(prompt_ids, params, request_id, namespace)
            except (ValueError, TensorParallelError) as e:
                self._deliver(request_id, e)
        elif cmd == "abort":
            out = self.engine.abort(arg)
            if out is not None:
                self._deliver(arg, out)
        elif cmd == "pause":
            self.engine.set_paused(*arg)
        elif cmd == "call":
            fn, done = arg
            try:
                done.put(fn(self.engine))
            except Exception as e:  # handed back to the caller
                done.put(e)

    def _loop(self) -> None:
        while not self._stopped.is_set():
            if time.monotonic() >= self._next_stats:
                self._stats = self.engine.stats()
                self._next_stats = time.monotonic() + _STATS_INTERVAL_S
            try:
                block = not self.engine.has_runnable
                cmd, arg = self._inbox.get(block=block, timeout=0.5 if block else None)
                if cmd == "stop":
                    return
                self._handle(cmd, arg)
                continue
            except queue.Empty:
                pass
            if not self.engine.has_runnable:
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:
                logger.exception("engine step failed; failing every running request")
                for rid in list(self._streams):
                    self.engine.abort(rid)
                    self._deliver(rid, RuntimeError(f"engine step failed: {e}"))
                continue
            for out in outputs:
                if out.error is None:
                    self._deliver(out.request_id, out)
                else:  # the request's own fault is a ValueError: the server's 400
                    error = ValueError if out.is_refused else RuntimeError
                    self._deliver(out.request_id, error(out.error))


def _num_bytes(out: RequestOutput) -> int:
    """What an output counts in its stream's backlog (as the token message a node sends)."""
    return len(out.request_id) + token_bytes(len(out.new_token_ids), out.logprobs)
