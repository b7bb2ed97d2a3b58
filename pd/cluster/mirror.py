"""``MirrorSync``: keeps the coordinator's mirror of every node's cache in step with the node.

The coordinator replays each node's cache events. When it sees a gap in a node's ``seq`` (events
were lost: the node's bounded queue overflowed, or a frame was dropped), it lists the node in
``nodes_to_resync``; a server that attaches to running nodes has no mirror of them at all. In
both cases the node is asked to ``resync_cache``: it sends its whole cache down its event stream
(a ``reset``, then ``inserted`` paths), so the events published before the snapshot are
superseded and those after it apply in order. The client reports each ``reset`` the
coordinator applies (``on_reset``); a request unanswered for ``retry_s`` is sent again.
``request(node_id)`` returns how many events the node sent (0: it keeps no prefix cache, so
there is nothing to wait for).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pd.router.coordinator import Coordinator

logger = logging.getLogger(__name__)


class MirrorSync:
    def __init__(
        self,
        coordinator: Coordinator,
        request: Callable[[str], Awaitable[Any]] | None,
        interval_s: float,
        retry_s: float = 10.0,
    ) -> None:
        self.coordinator = coordinator
        self.interval_s = interval_s
        self.retry_s = retry_s
        self._request = request  # asks a node for its snapshot (the launcher's Ray call)
        self._asked: dict[str, float] = {}  # node -> when its snapshot was last asked for
        self._first: set[str] = set()  # attached nodes whose first snapshot has not come
        self._tasks: set[asyncio.Task[None]] = set()
        self.num_requested = 0

    @property
    def is_settled(self) -> bool:
        """Every attached node's first snapshot has been applied."""
        return not self._first

    def expect_snapshot(self, node_id: str) -> None:
        """``node_id`` was attached: the coordinator knows nothing of its cache yet."""
        self._first.add(node_id)

    def forget(self, node_id: str) -> None:
        self._asked.pop(node_id, None)
        self._first.discard(node_id)

    def on_reset(self, node_id: str) -> None:
        """The head of a snapshot of ``node_id`` was applied."""
        self._asked.pop(node_id, None)
        self._first.discard(node_id)

    async def run(self) -> None:
        if self._request is None:
            return
        try:
            while True:
                self.ask_where_needed()
                await asyncio.sleep(self.interval_s)
        finally:
            for task in self._tasks:
                task.cancel()

    def ask_where_needed(self) -> None:
        now = time.monotonic()
        for node_id in [*self.coordinator.nodes_to_resync, *self._first]:
            if now - self._asked.get(node_id, -self.retry_s) >= self.retry_s:
                self._asked[node_id] = now
                self.num_requested += 1
                task = asyncio.ensure_future(self._ask(node_id))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _ask(self, node_id: str) -> None:
        assert self._request is not None
        try:
            if await self._request(node_id) == 0:  # it keeps no prefix cache: nothing to mirror
                self.on_reset(node_id)
        except Exception as e:  # a dead node is the watchdog's to find; asked again later
            logger.warning("could not ask %s for a cache snapshot: %s", node_id, e)
