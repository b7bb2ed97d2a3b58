"""``Backlog``: one streamed request's token messages that came from its nodes and that its
reader has not taken yet (all its choices together), and the push-back they cause.

1. The engine's side (the cluster client, for each token message of any choice) ``add``s the
   message's bytes (``TokenMsg.num_bytes``: its frame's size); the reader's side ``take``s them
   when it has read the message. The reader reads only as its client takes the answer (the
   server's stream pipe waits while it holds ``max_stream_buffer_bytes``), so a client that
   falls behind leaves these bytes queued.
2. Past ``high_bytes`` the backlog is paused: each choice's watcher hears ``Flow.PAUSE`` (the
   cluster client asks the choice's decode node to leave it out of its steps: nothing more is
   made for it); once it is back to ``high_bytes // 2`` they hear ``Flow.RESUME``.
3. Paused for ``max_pause_s`` in one go (its client did not catch up): they hear
   ``Flow.STALLED`` and end the request (its nodes drop it, its KV is freed); its stream raises
   ``ReaderStalled`` once its reader reaches that point.

So what is queued is at most ``high_bytes`` plus what the nodes sent before the pause reached
them (a step or two per choice).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable


class ReaderStalled(RuntimeError):
    """The request's client did not catch up with its answer in time: it was ended."""


class Flow(enum.Enum):
    PAUSE = enum.auto()
    RESUME = enum.auto()
    STALLED = enum.auto()


class Backlog:
    def __init__(self, high_bytes: int, max_pause_s: float) -> None:
        assert high_bytes >= 1 and max_pause_s > 0, (high_bytes, max_pause_s)
        self.high_bytes = high_bytes
        self.low_bytes = high_bytes // 2
        self.max_pause_s = max_pause_s
        self.num_bytes = 0
        self.num_pauses = 0
        self.is_paused = False
        self.is_stalled = False
        self._watchers: list[Callable[[Flow], None]] = []
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, on_flow: Callable[[Flow], None]) -> None:
        """Tell ``on_flow`` of each change from now on (a choice's stream, while it runs)."""
        self._watchers.append(on_flow)

    def unwatch(self, on_flow: Callable[[Flow], None]) -> None:
        self._watchers.remove(on_flow)

    def add(self, num_bytes: int) -> None:
        """A token message of ``num_bytes`` is queued for the reader."""
        self.num_bytes += num_bytes
        if not self.is_paused and self.num_bytes > self.high_bytes:
            self.is_paused = True
            self.num_pauses += 1
            self._timer = asyncio.get_running_loop().call_later(self.max_pause_s, self._stall)
            self._tell(Flow.PAUSE)

    def take(self, num_bytes: int) -> None:
        """The reader took a message of ``num_bytes`` (or its stream ended without it)."""
        self.num_bytes -= num_bytes
        assert self.num_bytes >= 0, self.num_bytes
        if self.is_paused and not self.is_stalled and self.num_bytes <= self.low_bytes:
            self.is_paused = False
            self._cancel_timer()
            self._tell(Flow.RESUME)

    def _stall(self) -> None:
        self._timer = None
        if self.is_paused:
            self.is_stalled = True
            self._tell(Flow.STALLED)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tell(self, flow: Flow) -> None:
        for on_flow in list(self._watchers):
            on_flow(flow)
