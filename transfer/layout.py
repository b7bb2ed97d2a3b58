"""KV buffers seen layer by layer, and the wire plan: in which token order and in which pieces
a transfer's rows travel, so that as few sides as possible copy through a staging buffer.

Both ends must post messages of the same sizes in the same order. The sender knows both slot
lists (the receiver's come in ``TransferReadyMsg``), so it picks a ``WirePlan`` and names it
in ``TransferStartMsg``; each side then decides on its own, from its own slots, whether it
can move every piece straight from/into its pool (each piece one ascending run of slots) or
must gather/scatter through a staging buffer. Message order per layer: for each buffer of the
layer (K, then V), for each segment: ``segment_len * row_elems`` elements.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8)
# Byte-copy stand-ins by width: gather/scatter move raw bytes, never arithmetic on values.
_WIDE_DTYPES = {
    16: torch.complex128,
    8: torch.int64,
    4: torch.int32,
    2: torch.int16,
    1: torch.uint8,
}
# More pieces than this per buffer and a layer's messages get small enough that their
# per-message cost (a round trip of gloo bookkeeping) beats one staging copy.
MAX_SEGMENTS = 16


class KVLayout:
    """A flat buffer list ``k[0..L-1] + v[0..L-1]`` (any number of buffers per layer) seen
    layer by layer: layer i is buffers ``i, i + L, i + 2L, ...``. Every buffer is indexed by
    slot on dim 0: ``[num_slots, ...]``."""

    def __init__(self, buffers: Sequence[torch.Tensor], num_layers: int) -> None:
        if num_layers < 1 or not buffers or len(buffers) % num_layers:
            raise ValueError(f"{len(buffers)} buffers do not split into {num_layers} layers")
        first = buffers[0]
        for b in buffers:
            if b.dtype != first.dtype or b.device != first.device or b.shape[0] != first.shape[0]:
                raise ValueError(
                    f"buffers differ: {b.dtype}/{b.device}/{b.shape[0]} slots vs "
                    f"{first.dtype}/{first.device}/{first.shape[0]} slots"
                )
            if not b.is_contiguous():
                raise ValueError("KV buffers must be contiguous")
        if first.dtype not in DTYPES:
            raise ValueError(f"unsupported KV dtype {first.dtype}")
        self.layers = [list(buffers[i::num_layers]) for i in range(num_layers)]
        sizes = {sum(b[0].numel() for b in layer) for layer in self.layers}
        if len(sizes) != 1:
            raise ValueError(f"layers hold different numbers of elements per token: {sizes}")
        row_bytes = {b[0].numel() * b.dtype.itemsize for b in buffers}
        width = next(w for w in (16, 8, 4, 2, 1) if all(r % w == 0 for r in row_bytes))
        self._wide_dtype = _WIDE_DTYPES[width]
        self.num_layers = num_layers
        self.num_slots = first.shape[0]
        self.elems_per_token = sizes.pop()
        self.dtype = first.dtype
        self.device = first.device

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def num_bytes_per_token(self) -> int:
        return self.num_layers * self.elems_per_token * self.dtype.itemsize

    def gather(self, layer: int, slots: torch.Tensor, out: torch.Tensor) -> None:
        # slots: [n] int64 on self.device; out: [n * elems_per_token] contiguous
        n = slots.numel()
        dst = out if out.device == self.device else torch.empty_like(out, device=self.device)
        for b, part in zip(self.layers[layer], self.split(layer, dst, n), strict=True):
            torch.index_select(self._rows(b), 0, slots, out=self._rows(part.view(n, -1)))
        if dst is not out:
            out.copy_(dst)

    def scatter(self, layer: int, slots: torch.Tensor, src: torch.Tensor) -> None:
        n = slots.numel()
        src = src.to(self.device, non_blocking=False)
        parts = self.split(layer, src, n)
        if self.device.type == "cpu":
            # numpy's put copies each row with one memmove, cheaper in CPU than index_copy_
            # (bench_transfer.py's components line), and CPU is what two cores run out of.
            idx = slots.numpy()
            for b, part in zip(self.layers[layer], parts, strict=True):
                np.put(_void_rows(b), idx, _void_rows(part.view(n, -1)))
            return
        for b, part in zip(self.layers[layer], parts, strict=True):
            self._rows(b).index_copy_(0, slots, self._rows(part.view(n, -1)))

    def split(self, layer: int, flat: torch.Tensor, n: int) -> list[torch.Tensor]:
        """A gathered layer ``[n * elems_per_token]`` cut into one flat part per buffer."""
        sizes = [n * b[0].numel() for b in self.layers[layer]]
        return list(flat.split(sizes))

    def pieces(self, layer: int, flat: torch.Tensor, segments: Sequence[int]) -> list[torch.Tensor]:
        """A gathered layer cut into its messages: per buffer, per segment (no copy)."""
        out: list[torch.Tensor] = []
        for b, part in zip(self.layers[layer], self.split(layer, flat, sum(segments)), strict=True):
            row = b[0].numel()
            out += part.split([s * row for s in segments])
        return out

    def views(
        self, layer: int, firsts: Sequence[int], segments: Sequence[int]
    ) -> list[torch.Tensor]:
        """The layer's messages straight in the pool: segment j is slots
        ``[firsts[j], firsts[j] + segments[j])`` of each buffer, flat, no copy."""
        return [
            b[a : a + s].view(-1)
            for b in self.layers[layer]
            for a, s in zip(firsts, segments, strict=True)
        ]

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as ``[rows, row_bytes / w]`` of a w-byte dtype: the same bytes in fewer
        elements. CPU index_copy_ costs per element, so 16-byte elements scatter faster."""
        rows = t.view(t.shape[0], -1)
        try:
            return rows.view(self._wide_dtype)
        except RuntimeError:  # a view whose storage offset is not aligned to w
            return rows


def _void_rows(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor ``[rows, ...]`` as a numpy array of ``rows`` opaque row-sized items
    (no copy; through uint8 because numpy has no bfloat16)."""
    rows = t.view(t.shape[0], -1).view(torch.uint8)
    return rows.numpy().view(np.dtype((np.void, rows.shape[1]))).reshape(t.shape[0])


class WirePlan(NamedTuple):
    """How one transfer's rows travel. ``by_dst``: in ascending destination-slot order (else
    in token order). ``segments``: token counts of the pieces, summing to the token count."""

    by_dst: bool
    segments: list[int]


def _run_starts(slots: torch.Tensor) -> set[int]:
    """Positions (> 0) where ``slots`` stops being ``prev + 1``: the starts of its runs."""
    if slots.numel() < 2:
        return set()
    return set((torch.nonzero(slots.diff() != 1).flatten() + 1).tolist())


def _lengths(cuts: set[int], n: int) -> list[int]:
    bounds = [0, *sorted(cuts), n]
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


def in_wire_order(slots: torch.Tensor, dst: torch.Tensor, by_dst: bool) -> torch.Tensor:
    """``slots`` (token order) reordered as the plan sends them; ``dst``: the receiver's."""
    return slots[torch.argsort(dst, stable=True)] if by_dst else slots


def plan_wire(src: torch.Tensor, dst: torch.Tensor) -> WirePlan:
    """The order and pieces that leave the fewest sides copying through a staging buffer,
    then the fewest messages. Cutting at a side's run starts lets that side send (receive)
    each piece as a view of its pool; a piece count over ``MAX_SEGMENTS`` is not worth it."""
    n = src.numel()
    assert n == dst.numel() >= 1, (n, dst.numel())
    best: tuple[int, int, int] | None = None
    plan = WirePlan(True, [n])
    for by_dst in (True, False):  # on a tie the destination order: sorted writes are cheaper
        s_cuts = _run_starts(in_wire_order(src, dst, by_dst))
        d_cuts = _run_starts(in_wire_order(dst, dst, by_dst))
        options = [(0, s_cuts | d_cuts), (1, d_cuts), (1, s_cuts), (2, set())]
        staged, cuts = next((k, c) for k, c in options if len(c) < MAX_SEGMENTS)
        key = (staged, len(cuts), 0 if by_dst else 1)
        if best is None or key < best:
            best, plan = key, WirePlan(by_dst, _lengths(cuts, n))
    return plan


def run_firsts(slots_w: torch.Tensor, segments: Sequence[int]) -> list[int] | None:
    """First slot of each segment if every segment of ``slots_w`` (wire order) is one
    ascending run (the side can use pool views), else None (it stages)."""
    if slots_w.numel() != sum(segments) or min(segments, default=0) < 1:
        raise ValueError(f"{slots_w.numel()} slots do not split into segments {segments}")
    starts = [0]
    for s in segments[:-1]:
        starts.append(starts[-1] + s)
    if not _run_starts(slots_w) <= set(starts[1:]):
        return None
    return slots_w[starts].tolist()
