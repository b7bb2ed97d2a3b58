"""The cluster client's event loop as other threads reach it (``LoopHandoff``), and the tasks a
part keeps running there (``TaskSet``).

Once ``ClusterClient.start()`` ran, the client's state (its node table, the coordinator, the
flights, the zmq sockets) belongs to its event loop. ``LoopHandoff.call(fn)`` runs a membership
change or read there and returns its result, whichever thread it comes from.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopHandoff:
    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None  # None before ``bind``

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """From now on the state is ``loop``'s (the client's ``start``)."""
        assert self.loop is None, "the client's state has an event loop already"
        self.loop = loop

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` where the client's state may be touched, and return its result. A call
        comes
        - on the bound loop (the watchdog, the launcher's tasks): ``fn`` runs at once;
        - from another thread while that loop runs: ``fn`` is handed to the loop
          (``call_soon_threadsafe``) and this thread waits for its result;
        - before ``bind``: ``fn`` runs on the caller's thread (the launcher registers its
          first nodes so): no loop, reader or watchdog exists yet, so nothing else touches
          the state.
        After the loop stopped, nothing can run there: RuntimeError."""
        loop = self.loop
        if loop is None:
            return fn()
        if _running_loop() is loop:
            return fn()
        if not loop.is_running():
            raise RuntimeError("the cluster client's event loop has stopped")
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except BaseException as e:  # handed to the calling thread
                done.set_exception(e)

        loop.call_soon_threadsafe(run)
        return done.result(timeout=60)


class TaskSet:
    """Tasks a part started on the running loop, kept until they end: the loop itself keeps
    only weak references to tasks."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def cancel_all(self) -> None:
        """Cancel every task and wait for each to end."""
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # none on this thread
        return None
