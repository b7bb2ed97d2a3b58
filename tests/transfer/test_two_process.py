"""Two real processes, each with its own KV pool, over real zmq and a real gloo pair.

The test process is one node, a spawned child the other; children are killed in ``finally``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.transfer.helpers import TrackingOwner, buffers, make_pool, run_until
from tests.transfer.procs import SRC_SEED, receiver_main, sender_main
from transfer.agent import TransferAgent
from transfer.state import KVPoll, TransferConfig

NUM_SLOTS = 256
CFG = TransferConfig(
    backend="gloo", handshake_timeout_s=20.0, timeout_s=3.0, connect_timeout_s=20.0
)
CTX = mp.get_context("spawn")


@pytest.fixture
def children() -> Iterator[list[Any]]:
    procs: list[Any] = []
    yield procs
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)


def _get(q: mp.Queue[Any], kind: str, timeout_s: float = 30.0) -> tuple[Any, ...]:
    """Next message of ``kind`` from a child (others skipped); a child error fails the test."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            msg = q.get(timeout=max(end - time.monotonic(), 0.01))
        except queue.Empty:
            raise AssertionError(f"no {kind!r} from the child within {timeout_s} s") from None
        if msg[0] == "error":
            raise AssertionError(f"child failed:\n{msg[1]}")
        if msg[0] == kind:
            return msg


def _child_reaches(q: mp.Queue[Any], state: str, agent: TransferAgent, timeout_s: float) -> bool:
    """Drive ``agent`` until the child reports one of its transfers in ``state``."""

    def seen() -> bool:
        while True:
            try:
                msg = q.get_nowait()
            except queue.Empty:
                return False
            if msg[0] == "error":
                raise AssertionError(f"child failed:\n{msg[1]}")
            if msg[0] == "state" and msg[2] == state:
                return True

    return run_until(seen, [agent], timeout_s)


def _scattered(gen: torch.Generator, n: int) -> list[int]:
    return torch.randperm(NUM_SLOTS, generator=gen)[:n].tolist()


def _start_receiver(
    children: list[Any],
    expect: dict[str, list[int]],
    device: str = "cpu",
    cfg: TransferConfig = CFG,
):
    out, cmd = CTX.Queue(), CTX.Queue()
    p = CTX.Process(target=receiver_main, args=(cfg, expect, NUM_SLOTS, device, out, cmd))
    p.start()
    children.append(p)
    return p, out, cmd, _get(out, "endpoint")[1]


@pytest.mark.timeout(60)
def test_two_processes_move_scattered_slots_of_concurrent_transfers(children) -> None:
    gen = torch.Generator().manual_seed(0)
    plan = {f"req-{i}": _scattered(gen, n) for i, n in enumerate([40, 17, 60, 33])}
    _, out, cmd, endpoint = _start_receiver(children, plan)
    src = make_pool(SRC_SEED, NUM_SLOTS)
    agent = TransferAgent(CFG, buffers(src), src.num_layers)
    try:
        senders = {t: agent.sender(t, endpoint, len(sl)) for t, sl in plan.items()}
        for t, sl in plan.items():
            senders[t].send(sl)
        assert run_until(lambda: all(s.poll().is_final for s in senders.values()), [agent], 30)
        assert {t: s.poll() for t, s in senders.items()} == dict.fromkeys(plan, KVPoll.SUCCESS)
        _, states, num_free = _get(out, "result")  # checked bit-exact and untouched there
        assert states == {t: ("SUCCESS", None) for t in plan}
        assert num_free == NUM_SLOTS - 150
    finally:
        cmd.put("exit")
        agent.close()


@pytest.mark.timeout(60)
def test_receiver_dies_mid_transfer_sender_fails_within_timeout(children) -> None:
    proc, out, _, endpoint = _start_receiver(children, {"t": list(range(20))})
    src = make_pool(SRC_SEED, NUM_SLOTS)
    agent = TransferAgent(CFG, buffers(src), src.num_layers)
    try:
        snd = agent.sender("t", endpoint, 20)
        snd.send(list(range(20)), num_ready_layers=1)  # layer 0 goes, then it waits
        assert _child_reaches(out, "TRANSFERRING", agent, 30)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)
        t0 = time.monotonic()
        snd.set_ready_layers(src.num_layers)
        assert run_until(lambda: snd.poll().is_final, [agent], CFG.timeout_s + 2)
        assert snd.poll() == KVPoll.FAILED
        assert time.monotonic() - t0 <= CFG.timeout_s + 0.5
        # The worker's own wait ends by the same deadline, and then the pair is dropped.
        assert run_until(lambda: agent.num_pairs == 0, [agent], 2), "broken pair kept"
    finally:
        agent.close()


@pytest.mark.timeout(60)
def test_sender_dies_receiver_frees_reserved_slots(children) -> None:
    dst = make_pool(None, NUM_SLOTS)
    owner = TrackingOwner(NUM_SLOTS)
    agent = TransferAgent(CFG, buffers(dst), dst.num_layers, owner)
    out: mp.Queue[Any] = CTX.Queue()
    plan = {"mid": (list(range(30)), 1), "idle": (list(range(30, 40)), -1)}
    proc = CTX.Process(target=sender_main, args=(CFG, agent.endpoint, plan, NUM_SLOTS, out))
    proc.start()
    children.append(proc)
    try:
        mid, idle = agent.receiver("mid"), agent.receiver("idle")
        ok = run_until(
            lambda: mid.poll() == KVPoll.TRANSFERRING and idle.poll() == KVPoll.WAITING, [agent], 30
        )
        assert ok, (mid.poll(), idle.poll())
        assert owner.alloc.num_free_slots == NUM_SLOTS - 40
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert run_until(lambda: len(owner.released) == 2, [agent], CFG.timeout_s + 2)
        assert time.monotonic() - t0 <= CFG.timeout_s + 0.5
        assert (mid.poll(), idle.poll()) == (KVPoll.FAILED, KVPoll.FAILED)
        assert owner.alloc.num_free_slots == NUM_SLOTS
        owner.check()
    finally:
        agent.close()


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_nccl_pair_on_two_gpus(children) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip(
            f"NCCL needs two GPUs ({torch.cuda.device_count()} visible): it refuses two ranks "
            "on one GPU, and gloo p2p is CPU-only"
        )
    cfg = TransferConfig(backend="nccl", timeout_s=30.0, connect_timeout_s=60.0)
    gen = torch.Generator().manual_seed(0)
    plan = {f"req-{i}": _scattered(gen, n) for i, n in enumerate([40, 17, 60])}
    _, out, cmd, endpoint = _start_receiver(children, plan, device="cuda:1", cfg=cfg)
    src = make_pool(SRC_SEED, NUM_SLOTS, device="cuda:0")
    agent = TransferAgent(cfg, buffers(src), src.num_layers)
    try:
        senders = {t: agent.sender(t, endpoint, len(sl)) for t, sl in plan.items()}
        for t, sl in plan.items():
            senders[t].send(sl)
        assert run_until(lambda: all(s.poll().is_final for s in senders.values()), [agent], 90)
        assert {t: s.poll() for t, s in senders.items()} == dict.fromkeys(plan, KVPoll.SUCCESS)
        _, states, _ = _get(out, "result", 60)  # bit-exact and untouched, checked there
        assert states == {t: ("SUCCESS", None) for t in plan}
    finally:
        cmd.put("exit")
        agent.close()
