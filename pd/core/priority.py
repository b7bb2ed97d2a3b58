"""vLLM's ``priority`` (an integer, lower runs first, default 0) as a queue order that cannot
starve anybody.

Every queue that honours it (the server's admission queue, the coordinator's queue for room,
the schedulers' ``waiting``) inserts with ``insert_ranked``:

1. a newcomer goes behind every entry of its priority or a lower one (ties: arrival order);
2. it goes ahead of the entries of a higher (worse) priority behind them, each of which counts
   being overtaken (``num_overtaken``);
3. an entry overtaken ``MAX_OVERTAKES`` times is overtaken no more: nothing new goes ahead of
   it. So a request waits for at most what was ahead of it when it came plus
   ``MAX_OVERTAKES`` later arrivals, whatever stream of better priorities keeps coming.

With every priority 0 (the default) this is a FIFO: step 2 never happens, and an insert
costs O(1).
"""

from __future__ import annotations

from collections.abc import MutableSequence
from typing import Protocol, TypeVar

MAX_OVERTAKES = 16  # later arrivals that may go ahead of one waiting entry


class Ranked(Protocol):
    num_overtaken: int

    @property
    def priority(self) -> int: ...


R = TypeVar("R", bound=Ranked)


def insert_ranked(queue: MutableSequence[R], item: R, max_overtakes: int = MAX_OVERTAKES) -> int:
    """Insert ``item`` where its priority puts it (see the module); return its index."""
    assert max_overtakes >= 0, max_overtakes
    i = len(queue)
    while i > 0:
        prev = queue[i - 1]
        if prev.priority <= item.priority or prev.num_overtaken >= max_overtakes:
            break
        i -= 1
    for j in range(i, len(queue)):
        queue[j].num_overtaken += 1
    queue.insert(i, item)
    return i
