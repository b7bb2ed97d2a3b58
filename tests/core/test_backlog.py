"""``Backlog``: a stream's queued token bytes pause it past the high mark, resume it at half,
and stall it when paused too long."""

from __future__ import annotations

import asyncio

from pd.core.backlog import Backlog, Flow


def test_pause_at_high_resume_at_low_and_stall_when_paused_too_long():
    async def go() -> list[Flow]:
        heard: list[Flow] = []
        b = Backlog(high_bytes=1000, max_pause_s=0.2)
        b.watch(heard.append)
        b.add(1000)
        assert not b.is_paused and heard == []  # at the mark: not past it
        b.add(1)
        assert b.is_paused and heard == [Flow.PAUSE]
        b.add(5000)  # what the node sent before the pause reached it: no second pause
        b.take(5000)
        assert heard == [Flow.PAUSE]
        b.take(501)  # down to 500 = high // 2
        assert not b.is_paused and heard == [Flow.PAUSE, Flow.RESUME]
        await asyncio.sleep(0.3)  # the first pause's timer was cancelled
        assert heard == [Flow.PAUSE, Flow.RESUME]
        b.add(600)
        await asyncio.sleep(0.3)  # paused for longer than max_pause_s
        assert b.is_stalled and heard == [Flow.PAUSE, Flow.RESUME, Flow.PAUSE, Flow.STALLED]
        b.take(b.num_bytes)  # a stalled stream is never resumed
        assert heard[-1] is Flow.STALLED and b.num_pauses == 2
        return heard

    asyncio.run(go())
