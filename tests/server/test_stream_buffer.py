"""``StreamPipe`` and ``StreamBytes`` on their own: the bounds on what a stream holds for its
client, and the one call that gives its admission place back."""

from __future__ import annotations

import asyncio

import pytest

from pd.server.http.stream_buffer import MAX_SEND_BYTES, StreamBytes, StreamPipe

pytestmark = pytest.mark.timeout(10)


def _pipe(max_bytes: int, budget: StreamBytes) -> tuple[StreamPipe, list[int]]:
    released: list[int] = []
    return StreamPipe(max_bytes, budget, lambda: released.append(1)), released


def test_put_waits_while_the_pipe_is_full_and_take_sends_in_pieces() -> None:
    async def run() -> None:
        budget = StreamBytes(1 << 20)
        pipe, released = _pipe(1000, budget)
        await pipe.put(b"a" * 600)
        await pipe.put(b"b" * 600)  # under the cap before it: taken, 200 past it
        put = asyncio.ensure_future(pipe.put(b"c" * 10))
        await asyncio.sleep(0.01)
        assert not put.done() and pipe.num_bytes == 1200  # full: the request waits
        assert await pipe.take() == b"a" * 600 + b"b" * 600  # one send, under 64 KiB
        await asyncio.wait_for(put, 1)
        pipe.close()
        # generated: its place goes back, its 10 bytes left are held by the budget
        assert released == [1] and budget.num_streams == 1 and budget.num_bytes == 10
        assert await pipe.take() == b"c" * 10
        assert await pipe.take() is None
        assert budget.num_streams == 0 and budget.num_bytes == 0
        pipe.end()
        assert released == [1] and budget.num_streams == 0  # exactly once

    asyncio.run(run())


def test_a_closed_pipe_gives_its_place_back_at_once_when_its_bytes_fit_the_budget() -> None:
    async def run() -> None:
        budget = StreamBytes(100)
        a, a_released = _pipe(1 << 20, budget)
        b, b_released = _pipe(1 << 20, budget)
        for _ in range(7):
            await a.put(b"x" * 10)
            await b.put(b"y" * 10)
        a.close()
        assert a_released == [1] and budget.num_bytes == 70 and a.is_released
        b.close()  # 70 more do not fit beside a's
        assert b_released == [] and not b.is_released
        assert len(await b.take()) == 70  # its client read it all: nothing to hold
        assert b_released == [1] and budget.num_bytes == 70
        assert len(await a.take()) == 70
        assert budget.num_bytes == 0 and budget.num_streams == 0
        await asyncio.wait_for(budget.wait_empty(), 1)

    asyncio.run(run())


def test_a_pipe_released_then_cut_gives_the_budget_back() -> None:
    async def run() -> None:
        budget = StreamBytes(1 << 20)
        pipe, released = _pipe(1 << 20, budget)
        for _ in range(3):
            await pipe.put(b"z" * MAX_SEND_BYTES)
        pipe.close()
        assert released == [1] and budget.num_bytes == 3 * MAX_SEND_BYTES
        assert len(await pipe.take()) == MAX_SEND_BYTES  # one send at most 64 KiB
        assert budget.num_bytes == 2 * MAX_SEND_BYTES and budget.num_streams == 1
        pipe.end()  # the client was cut off
        assert budget.num_bytes == 0 and budget.num_streams == 0 and released == [1]
        # cut before its generation ended: the place goes back at the end, exactly once
        other, other_released = _pipe(1 << 20, budget)
        await other.put(b"w")
        other.end()
        other.close()
        assert other_released == [1] and budget.num_streams == 0

    asyncio.run(run())
