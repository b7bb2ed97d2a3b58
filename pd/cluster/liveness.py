"""``Liveness``: which nodes are alive, as the server sees them.

A node is dead when its Ray actor is gone (a ping fails) or when its loop has published nothing
for ``heartbeat_timeout_s``: its stats are its heartbeat, sent by the loop thread itself (also
between the layers of a long forward pass). The actor answers pings from another thread, so an
unanswered ping proves nothing and a stuck loop is only seen by its silence; only a node that
has been silent since the watchdog's last look is pinged (a ping is a Ray call, which costs
the server far more than a beat it reads: BENCHMARKS.md, the front end's own cost).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any


class Liveness:
    def __init__(
        self,
        heartbeat_timeout_s: float,
        watch_interval_s: float,
        ping_timeout_s: float,
        ping: Callable[[str], Awaitable[Any]] | None,
        on_dead: Callable[[str, str], None],
    ) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.watch_interval_s = watch_interval_s
        self.ping_timeout_s = ping_timeout_s
        self._ping = ping
        self._on_dead = on_dead  # (node_id, why), on the event loop; the node is forgotten
        self._last_heard: dict[str, float] = {}
        self._pings: dict[str, asyncio.Task[None]] = {}

    def watch(self, node_id: str) -> None:
        """A node joined: its first beat is due within the heartbeat timeout."""
        self._last_heard[node_id] = time.monotonic()

    def forget(self, node_id: str) -> None:
        self._last_heard.pop(node_id, None)

    def heard(self, node_id: str) -> None:
        if node_id in self._last_heard:
            self._last_heard[node_id] = time.monotonic()

    async def run(self) -> None:
        """The watchdog: every ``watch_interval_s``, judge the heartbeats and ping the actors
        of the nodes not heard from since the last look (a node that beats is alive; one
        whose process died stops beating, so it is pinged at the next look or the one after,
        and its failed ping finds it dead long before its heartbeat timeout would)."""
        last_look = time.monotonic()
        try:
            while True:
                await asyncio.sleep(self.watch_interval_s)
                now = time.monotonic()
                for node_id, heard in list(self._last_heard.items()):
                    if now - heard > self.heartbeat_timeout_s:
                        why = f"no heartbeat for {now - heard:.1f} s"
                        self._dead(node_id, f"{why} (limit {self.heartbeat_timeout_s} s)")
                for node_id, heard in list(self._last_heard.items()):
                    if self._ping is not None and node_id not in self._pings and heard < last_look:
                        self._pings[node_id] = asyncio.ensure_future(self._ping_once(node_id))
                last_look = now
        finally:
            for task in self._pings.values():
                task.cancel()

    async def _ping_once(self, node_id: str) -> None:
        assert self._ping is not None
        try:
            await asyncio.wait_for(self._ping(node_id), self.ping_timeout_s)
        except TimeoutError:
            pass  # a slow answer is the heartbeat's to judge
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the actor is gone
            self._dead(node_id, f"{type(e).__name__}: {e}")
        finally:
            with contextlib.suppress(KeyError):
                del self._pings[node_id]

    def _dead(self, node_id: str, why: str) -> None:
        if node_id in self._last_heard:
            self.forget(node_id)
            self._on_dead(node_id, why)
