"""``priority`` (vLLM's: lower runs first, default 0) and ``n`` in admission and in per-key
limits: the admission queue ordered by priority then arrival with a bound on overtaking, the
schedulers' ``waiting`` likewise, ``n`` choices holding n places and counting n against a key."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from pd.core.priority import MAX_OVERTAKES, insert_ranked
from pd.server import ServerConfig, ServerMetrics
from pd.server.http.admission import Admission
from pd.server.http.errors import APIError
from tests.server.conftest import serve

pytestmark = pytest.mark.timeout(30)


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def _queue(adm: Admission, order: list[str], name: str, priority: int, places: int = 1):
    async def one() -> Any:
        ticket = await adm.admit(10.0, places, priority)
        order.append(name)
        return ticket

    task = asyncio.ensure_future(one())
    await asyncio.sleep(0)
    return task


@pytest.mark.anyio
async def test_a_priority_minus_one_request_runs_before_earlier_priority_0_ones() -> None:
    adm = Admission(max_inflight=1, max_queued=8, metrics=ServerMetrics())
    holder = adm.try_admit()
    assert holder is not None
    order: list[str] = []
    tasks = [await _queue(adm, order, name, 0) for name in ("a", "b", "c")]
    tasks.append(await _queue(adm, order, "urgent", -1))
    tasks.append(await _queue(adm, order, "d", 0))
    holder.release()
    for _ in range(5):
        await _settle()
        (await tasks[[*("a", "b", "c", "urgent", "d")].index(order[-1])]).release()
    await _settle()
    assert order == ["urgent", "a", "b", "c", "d"]
    assert (adm.num_inflight, adm.num_queued) == (0, 0)


@pytest.mark.anyio
async def test_a_stream_of_better_priorities_overtakes_one_request_a_bounded_number_of_times() -> (
    None
):
    adm = Admission(max_inflight=1, max_queued=100, metrics=ServerMetrics())
    holder = adm.try_admit()
    assert holder is not None
    order: list[str] = []
    tasks = {"low": await _queue(adm, order, "low", 5)}
    for i in range(MAX_OVERTAKES + 10):  # a steady stream of better priorities
        tasks[f"hi{i}"] = await _queue(adm, order, f"hi{i}", -1)
    holder.release()
    while len(order) < len(tasks):
        await _settle()
        (await tasks[order[-1]]).release()
    assert order.index("low") == MAX_OVERTAKES  # overtaken exactly MAX_OVERTAKES times


def test_insert_ranked_is_fifo_at_one_priority_and_bounds_overtaking() -> None:
    class E:
        def __init__(self, name: str, priority: int) -> None:
            self.name, self.priority, self.num_overtaken = name, priority, 0

    q: list[E] = []
    for name, p in [("a", 0), ("b", 0), ("c", 1), ("d", -2), ("e", 0)]:
        insert_ranked(q, E(name, p), max_overtakes=2)
    assert [e.name for e in q] == ["d", "a", "b", "e", "c"]
    # c has been overtaken twice (by d and e): nothing goes ahead of it any more
    insert_ranked(q, E("f", -5), max_overtakes=2)
    assert [e.name for e in q] == ["d", "a", "b", "e", "c", "f"]


@pytest.mark.anyio
async def test_n_choices_hold_n_places_and_wait_for_them_all() -> None:
    adm = Admission(max_inflight=4, max_queued=8, metrics=ServerMetrics())
    one = adm.try_admit(2)
    assert one is not None and adm.num_inflight == 2
    assert adm.try_admit(3) is None  # 3 more do not fit
    order: list[str] = []
    big = await _queue(adm, order, "n3", 0, places=3)
    small = await _queue(adm, order, "n1", 0, places=1)  # fits, but does not go around the head
    await _settle()
    assert order == []
    one.release()
    await _settle()
    assert order == ["n3", "n1"] and adm.num_inflight == 4
    (await big).release()
    (await small).release()
    assert adm.num_inflight == 0
    with pytest.raises(
        APIError, match="n=5 choices need 5 admission places at once; this server has 4"
    ):
        await adm.admit(1.0, 5)


A, B = "key-a-123", "key-b-456"


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.anyio
async def test_n_counts_against_a_keys_requests_in_flight_with_a_429_that_says_so(make_app) -> None:
    config = ServerConfig(api_key=(A, B), max_inflight_per_key=4)
    app, fake = make_app(config=config, output_ids=list(range(100, 140)), delay_s=0.05)
    limiter = app.state.key_limiter
    body = {"prompt": "hello", "max_tokens": 40, "stream": True, "n": 3}
    with serve(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            async with c.stream("POST", "/v1/completions", json=body, headers=_auth(A)) as s:
                assert s.status_code == 200
                assert limiter.num_inflight == {A: 3}
                r = await c.post("/v1/completions", json={"prompt": "x", "n": 2}, headers=_auth(A))
                assert r.status_code == 429, r.text
                msg = r.json()["error"]["message"]
                assert "n=2 choices" in msg and "has 3 in flight" in msg and "limit is 4" in msg
                r = await c.post(
                    "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=_auth(A)
                )
                assert r.status_code == 200  # one more fits
            for _ in range(200):
                if not limiter.num_inflight:
                    break
                await asyncio.sleep(0.02)
            assert limiter.num_inflight == {}
            assert app.state.server.admission.num_inflight == 0


@pytest.mark.anyio
async def test_a_keys_priority_comes_from_key_priority_and_is_its_ceiling(make_app) -> None:
    # A's requests may ask to run later than -3, never sooner (a tenant cannot outrank what
    # the operator gave it); B, with no priority configured, asks what it likes
    config = ServerConfig(api_key=(A, B), key_priority=(f"{A}=-3",))
    app, fake = make_app(config=config, output_ids=[100, 101])
    with serve(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            for key, body, want in [
                (A, {"prompt": "x", "max_tokens": 2}, -3),
                (B, {"prompt": "x", "max_tokens": 2}, 0),
                (A, {"prompt": "x", "max_tokens": 2, "priority": 4}, 4),
                (A, {"prompt": "x", "max_tokens": 2, "priority": -100}, -3),
                (B, {"prompt": "x", "max_tokens": 2, "priority": -100}, -100),
            ]:
                r = await c.post("/v1/completions", json=body, headers=_auth(key))
                assert r.status_code == 200, r.text
                assert fake.requests[-1][2].priority == want
    with pytest.raises(ValueError, match="names a key that is neither"):
        ServerConfig(api_key=(A,), key_priority=("nope=1",))
    with pytest.raises(ValueError, match="KEY=PRIORITY"):
        ServerConfig(api_key=(A,), key_priority=(f"{A}=high",))


@pytest.mark.anyio
async def test_the_coordinators_queue_for_room_serves_by_priority_then_arrival() -> None:
    from pd.cluster.room import RoomQueue, RoomTicket
    from pd.router.policy import NoCapacityError

    room = RoomQueue()
    free = [0]  # bookings the nodes have room for
    order: list[str] = []

    def book(name: str) -> str:
        if not free[0]:
            raise NoCapacityError("full")
        free[0] -= 1
        order.append(name)
        return name

    async def wait(name: str, priority: int) -> Any:
        return await room.wait(lambda: book(name), 1e18, RoomTicket(), priority=priority)

    tasks = []
    for name, priority in [("a", 0), ("b", 0), ("urgent", -1), ("c", 0)]:
        tasks.append(asyncio.ensure_future(wait(name, priority)))
        await _settle()
    assert room.num_waiting == 4 and order == []
    for _ in range(4):  # room for one at a time
        free[0] += 1
        room.wake()
        await _settle()
    await asyncio.gather(*tasks)
    assert order == ["urgent", "a", "b", "c"]
