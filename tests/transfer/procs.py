"""Child-process bodies for the two-process tests (spawned: each has its own KV pool)."""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from typing import Any

import torch

from tests.transfer.helpers import (
    TrackingOwner,
    assert_moved,
    assert_untouched,
    buffers,
    make_pool,
)
from transfer.agent import TransferAgent
from transfer.state import KVPoll, TransferConfig

SRC_SEED = 11


def receiver_main(
    cfg: TransferConfig,
    expect: dict[str, list[int]],
    num_slots: int,
    device: str,
    out: mp.Queue[Any],
    cmd: mp.Queue[Any],
) -> None:
    """Receive the transfers in ``expect`` (id -> the sender's source slots), check them
    against a pool rebuilt from the sender's seed, report, then wait for "exit"."""
    torch.set_num_threads(1)
    try:
        dst = make_pool(None, num_slots, device)
        owner = TrackingOwner(num_slots)
        agent = TransferAgent(cfg, buffers(dst), dst.num_layers, owner)
        out.put(("endpoint", agent.endpoint))
        handles = {t: agent.receiver(t) for t in expect}
        seen: set[tuple[str, KVPoll]] = set()
        end = time.monotonic() + 60
        while time.monotonic() < end and not all(h.poll().is_final for h in handles.values()):
            for t, h in handles.items():
                if (t, h.poll()) not in seen:
                    seen.add((t, h.poll()))
                    out.put(("state", t, h.poll().name))
            time.sleep(0.001)
        src = make_pool(SRC_SEED, num_slots, "cpu")
        written = []
        for t, h in handles.items():
            if h.poll() == KVPoll.SUCCESS:
                assert_moved(src, expect[t], dst, h.slots)
                written += h.slots
        assert_untouched(dst, written)
        owner.check()
        states = {t: (h.poll().name, h.failure) for t, h in handles.items()}
        out.put(("result", states, owner.alloc.num_free_slots))
        cmd.get(timeout=60)  # keep the sockets open until the sender has its acks
        agent.close()
    except Exception:  # report to the parent, which asserts
        out.put(("error", traceback.format_exc()))


def sender_main(
    cfg: TransferConfig,
    peer: str,
    plan: dict[str, tuple[list[int], int | None]],
    num_slots: int,
    out: mp.Queue[Any],
) -> None:
    """Start the transfers of ``plan`` (id -> (source slots, ready layers; -1 = never call
    send)) and keep polling them until killed."""
    torch.set_num_threads(1)
    src = make_pool(SRC_SEED, num_slots)
    agent = TransferAgent(cfg, buffers(src), src.num_layers)
    handles = {t: agent.sender(t, peer, len(slots)) for t, (slots, _) in plan.items()}
    for t, (slots, ready) in plan.items():
        if ready != -1:
            handles[t].send(slots, num_ready_layers=ready)
    seen: set[tuple[str, KVPoll]] = set()
    while True:
        for t, h in handles.items():
            if (t, h.poll()) not in seen:
                seen.add((t, h.poll()))
                out.put(("state", t, h.poll().name))
        time.sleep(0.001)
