"""The payload loops of one transfer: per layer, the messages of the wire plan, pipelined.

Gloo does much of a message's socket copy inside ``send``/``recv`` on the calling thread
(BENCHMARKS.md, "KV transfer"). A gather or scatter on that same thread therefore cannot overlap
the wire, so staging copies run on the pair's one copy thread (``copier``) while the pair thread
posts and waits on the messages.
Up to ``DEPTH`` layers are in flight per direction, in as many reused staging buffers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import torch

from transfer.backend import BaseTransferBackend, Pending
from transfer.layout import KVLayout, run_firsts

# Layers in flight per direction: 3 keeps a layer posted while the receiver scatters another
# (BENCHMARKS.md, "KV transfer").
DEPTH = 3


def _wait_all(ops: Sequence[Pending], remaining_s: Callable[[], float]) -> None:
    for p in ops:
        p.wait(remaining_s())


def _run_now(fn: Callable[[int], list[torch.Tensor]], layer: int) -> Future[list[torch.Tensor]]:
    done: Future[list[torch.Tensor]] = Future()
    try:
        done.set_result(fn(layer))
    except Exception as e:  # re-raised by result(), like a copier future
        done.set_exception(e)
    return done


def send_layers(
    be: BaseTransferBackend,
    lo: KVLayout,
    slots: torch.Tensor,
    segments: Sequence[int],
    copier: ThreadPoolExecutor,
    wait_ready: Callable[[int], None],
    remaining_s: Callable[[], float],
) -> None:
    """Send every layer of ``slots`` (wire order) cut into ``segments``. ``wait_ready(k)``
    blocks until layers below k may be read."""
    n = slots.numel()
    firsts = run_firsts(slots, segments) if lo.device == be.device else None
    size = n * lo.elems_per_token if firsts is None else 0
    bufs = [torch.empty(size, dtype=lo.dtype, device=be.device) for _ in range(DEPTH)]

    def prepare(layer: int) -> list[torch.Tensor]:
        wait_ready(layer + 1)  # after a cancel it returns: the rest is sent as is
        if firsts is not None:
            return lo.views(layer, firsts, segments)
        buf = bufs[layer % DEPTH]
        lo.gather(layer, slots, buf)
        return lo.pieces(layer, buf, segments)

    # Views need no copy: a hand-off to the copy thread would only add a wake-up per layer.
    submit = copier.submit if firsts is None else _run_now
    inflight: deque[tuple[int, list[Pending]]] = deque()
    nxt: Future[list[torch.Tensor]] = submit(prepare, 0)
    try:
        for layer in range(lo.num_layers):
            parts = nxt.result(remaining_s())
            # Layer + 1 is gathered into the buffer of layer + 1 - DEPTH: its sends must be done.
            while inflight and inflight[0][0] <= layer + 1 - DEPTH:
                _wait_all(inflight.popleft()[1], remaining_s)
            if layer + 1 < lo.num_layers:
                nxt = submit(prepare, layer + 1)  # gathers while this layer goes out
            inflight.append((layer, [be.isend(p) for p in parts]))
        for _, ops in inflight:
            _wait_all(ops, remaining_s)
    finally:
        wait_futures([nxt])  # never leave a copy running into a buffer or pool we give up


def recv_layers(
    be: BaseTransferBackend,
    lo: KVLayout,
    slots: torch.Tensor | None,
    num_tokens: int,
    segments: Sequence[int],
    copier: ThreadPoolExecutor,
    keep: Callable[[], bool],
    remaining_s: Callable[[], float],
) -> None:
    """Receive every layer into ``slots`` (wire order; None = read and drop). ``keep()``
    False (the receiver cancelled) stops scattering; the stream is still read to its end."""
    firsts = run_firsts(slots, segments) if slots is not None and lo.device == be.device else None
    size = num_tokens * lo.elems_per_token if firsts is None else 0
    bufs = [torch.empty(size, dtype=lo.dtype, device=be.device) for _ in range(DEPTH)]

    def post(layer: int) -> list[Pending]:
        if firsts is not None:  # straight into the pool: the slots stay reserved till we end
            parts = lo.views(layer, firsts, segments)
        else:
            parts = lo.pieces(layer, bufs[layer % DEPTH], segments)
        return [be.irecv(p) for p in parts]

    def scatter(layer: int) -> None:
        assert slots is not None
        lo.scatter(layer, slots, bufs[layer % DEPTH])

    num_layers = lo.num_layers
    inflight = deque(post(layer) for layer in range(min(DEPTH, num_layers)))
    next_post = len(inflight)
    scattering: Future[None] | None = None
    try:
        for layer in range(num_layers):
            _wait_all(inflight.popleft(), remaining_s)
            if scattering is not None:  # the previous layer's: done before its buffer is reused
                scattering.result(remaining_s())
                scattering = None
            if firsts is None and slots is not None and keep():
                scattering = copier.submit(scatter, layer)  # while the next layers arrive
                free_below = layer  # staging buffers of layers < free_below may be reused
            else:
                free_below = layer + 1
            while next_post < num_layers and next_post - DEPTH < free_below:
                inflight.append(post(next_post))
                next_post += 1
        if scattering is not None:
            scattering.result(remaining_s())
        assert next_post == num_layers and not inflight, (next_post, len(inflight))
    finally:
        if scattering is not None:
            wait_futures([scattering])  # the slots may be released once we return
