"""``TorchThread``: the one thread of a process that builds its model and then steps it.

OpenMP keeps a team of worker threads for each OS thread that runs parallel torch ops. Once a
process holds more of them than it has cores, libgomp stops spinning between parallel regions
and every op pays a futex wake (on 2 cores a model loaded on one thread and stepped on another
decoded at less than half its speed). So a loop that steps a model on a thread of its own
builds the model on that thread too:

    t = TorchThread("pd-engine")
    engine = t.run(lambda: Engine(cfg))   # built on t's thread; what build raises, raised here
    t.start(loop)                          # then the thread runs loop() until it returns
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class TorchThread:
    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], queue.SimpleQueue[Any] | None]] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._has_loop = False

    def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the thread (started on first use); its exception is raised here."""
        done: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._submit(fn, done)
        ok, value = done.get()
        if not ok:
            raise value
        return value

    @property
    def has_loop(self) -> bool:
        return self._has_loop

    def start(self, loop: Callable[[], None]) -> None:
        """Hand the thread ``loop``: it runs there until it returns, and the thread ends."""
        assert not self._has_loop, f"{self.name} already runs its loop"
        self._has_loop = True
        self._submit(loop, None)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the loop to return (a thread never given one ends now)."""
        if self._thread is None:
            return
        if not self._has_loop:
            self.start(lambda: None)
        self._thread.join(timeout)

    def _submit(self, fn: Callable[[], Any], done: queue.SimpleQueue[Any] | None) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()
        self._jobs.put((fn, done))

    def _serve(self) -> None:
        while True:
            fn, done = self._jobs.get()
            if done is None:  # the loop: the thread's last job
                fn()
                return
            try:
                done.put((True, fn()))
            except BaseException as e:  # handed to the caller of run()
                done.put((False, e))
