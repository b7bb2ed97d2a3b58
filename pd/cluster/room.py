"""``RoomQueue``: requests waiting for a node with room, by priority then arrival
(``pd.core.priority``: lower ``params.priority`` first, none overtaken more than
``MAX_OVERTAKES`` times; all at the default 0: first come, first served).

``wait(book, deadline, ticket)`` books at once when nobody waits and ``book()`` finds room
(it raises ``NoCapacityError`` when not). Otherwise the request queues; each ``wake()`` (a
request finished, a node joined) lets the first in line try again: on success it passes the
turn on (the next may fit too), on failure it keeps its place at the head. Nobody polls, and a
wait ends at its deadline (``TimeoutError``) or when its ticket is cancelled (an abort).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TypeVar

from pd.core.priority import insert_ranked
from pd.router.policy import NoCapacityError

T = TypeVar("T")


class RoomTicket:
    """One request's place in the queue; ``cancel()`` ends its wait (``wait`` returns None)."""

    def __init__(self) -> None:
        self.is_cancelled = False
        self.turn: asyncio.Future[None] | None = None

    def cancel(self) -> None:
        self.is_cancelled = True
        if self.turn is not None and not self.turn.done():
            self.turn.set_result(None)


class _Turn:
    """A place in the line: ``fut`` is set when it is this request's turn to try."""

    def __init__(self, fut: asyncio.Future[None], priority: int) -> None:
        self.fut = fut
        self.priority = priority
        self.num_overtaken = 0


class RoomQueue:
    def __init__(self) -> None:
        self._turns: list[_Turn] = []
        self.num_waiting = 0  # requests in wait(), the one trying included

    async def wait(
        self,
        book: Callable[[], T],
        deadline: float,
        ticket: RoomTicket,
        first: bool = False,
        priority: int = 0,
    ) -> T | None:
        """``book()``'s result once there is room; ``first``: queue at the head (a re-routed
        request came before the others), else by ``priority``."""
        self.num_waiting += 1
        try:
            if not self._turns and not ticket.is_cancelled:  # nobody to pass
                with contextlib.suppress(NoCapacityError):
                    return book()
            while not ticket.is_cancelled:
                ticket.turn = asyncio.get_running_loop().create_future()
                entry = _Turn(ticket.turn, priority)
                if first:
                    self._turns.insert(0, entry)
                else:
                    insert_ranked(self._turns, entry)
                left = max(deadline - time.monotonic(), 0.0)
                try:
                    await asyncio.wait_for(asyncio.shield(ticket.turn), left)
                except TimeoutError:
                    raise TimeoutError("no node had room within the request's deadline") from None
                if ticket.is_cancelled:
                    break
                try:
                    return book()
                except NoCapacityError:
                    first = True  # keep the head
            return None
        finally:
            self.num_waiting -= 1
            turn, ticket.turn = ticket.turn, None
            queued = [t for t in self._turns if t.fut is turn] if turn is not None else []
            if queued:
                self._turns.remove(queued[0])
            elif turn is not None and turn.done():
                self.wake()  # the turn came to this request: pass it on

    def wake(self) -> None:
        """Room may have appeared: let the first in line try."""
        while self._turns:
            turn = self._turns.pop(0).fut
            if not turn.done():
                turn.set_result(None)
                return
