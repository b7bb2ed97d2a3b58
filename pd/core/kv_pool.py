"""The paged KV pool: one slot per token, handed out in pages of ``page_size`` slots.

``SlotAllocator`` is plain Python (schedulers and caches use it without touching torch);
``KVPool`` owns the per-layer K and V tensors that the slots index into.

Slot arithmetic (page_size = 4):

    page p  ->  slots [p*4, p*4+1, p*4+2, p*4+3]
    slot s  ->  page s // 4

A request owns whole pages: its token i lives in slot ``slots[i]``, and ``extend`` fills the
free tail of its last page before taking a new page. Freeing a slot list frees the pages it
touches, so callers only ever free lists that own their pages outright (a cached prefix is
page-aligned, so the pages after it belong to the request alone).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch


class OutOfSlotsError(RuntimeError):
    """Raised when an allocation asks for more slots than are free."""


class SlotAllocator:
    """Free list of KV pages. All counts are in slots (tokens) unless a name says pages."""

    def __init__(self, num_slots: int, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_slots < page_size:
            raise ValueError(f"num_slots ({num_slots}) must be >= page_size ({page_size})")
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        # Pop from the end: low pages are handed out first, which keeps tests readable.
        self._free_pages: list[int] = list(range(self.num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * self.num_pages

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_pages) * self.page_size

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - self.num_free_slots

    def num_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def num_new_pages(self, slots: Sequence[int], new_len: int) -> int:
        """Pages ``extend(slots, new_len)`` would take from the free list."""
        return max(0, self.num_pages_for(new_len) - self.num_pages_for(len(slots)))

    def can_allocate(self, num_tokens: int) -> bool:
        return self.num_pages_for(num_tokens) <= len(self._free_pages)

    def can_extend(self, slots: Sequence[int], new_len: int) -> bool:
        return self.num_new_pages(slots, new_len) <= len(self._free_pages)

    def allocate(self, num_tokens: int) -> list[int]:
        """Slots for ``num_tokens`` new tokens, in whole pages (the tail page may be partial)."""
        return self.extend([], num_tokens)

    def extend(self, slots: list[int], new_len: int) -> list[int]:
        """Grow ``slots`` (in place) to ``new_len`` tokens and return it.

        Uses the free tail of the last page first; ``slots`` must start page-aligned.
        """
        if new_len < len(slots):
            raise ValueError(f"extend cannot shrink: {len(slots)} -> {new_len} slots")
        need = self.num_new_pages(slots, new_len)
        if need > len(self._free_pages):
            raise OutOfSlotsError(
                f"need {need} pages ({need * self.page_size} slots), "
                f"{len(self._free_pages)} pages ({self.num_free_slots} slots) free"
            )
        ps = self.page_size
        while len(slots) < new_len:
            if len(slots) % ps == 0:
                page = self._free_pages.pop()
                assert self._is_free[page], f"page {page} handed out twice"
                self._is_free[page] = 0
                base = page * ps
            else:
                base = slots[-1] + 1
            take = min(new_len - len(slots), ps - len(slots) % ps)
            slots.extend(range(base, base + take))
        return slots

    def truncate(self, slots: list[int], new_len: int) -> None:
        """Shrink ``slots`` (in place) to ``new_len`` tokens, freeing the pages it no longer
        touches (the rest of a partly kept page stays the list's free tail)."""
        if new_len >= len(slots):
            return
        num_kept = self.num_pages_for(new_len) * self.page_size
        dropped = slots[num_kept:]
        del slots[new_len:]
        if dropped:
            self.free(dropped)

    def free(self, slots: Iterable[int]) -> None:
        """Return the pages that ``slots`` touch to the free list."""
        ps = self.page_size
        pages = dict.fromkeys(s // ps for s in slots)
        for page in pages:
            if not 0 <= page < self.num_pages:
                raise ValueError(f"slot page {page} out of range [0, {self.num_pages})")
            if self._is_free[page]:
                raise AssertionError(f"double free of page {page} (slots {page * ps}..)")
            self._is_free[page] = 1
            self._free_pages.append(page)

    def check_integrity(self, owned: Iterable[Sequence[int]] = ()) -> None:
        """Every page is either free or in exactly one of ``owned`` (slot lists), never both."""
        assert len(self._free_pages) == sum(self._is_free), "free list and free map disagree"
        assert len(set(self._free_pages)) == len(self._free_pages), "page twice in free list"
        seen = bytearray(self.num_pages)
        for slots in owned:
            for page in dict.fromkeys(s // self.page_size for s in slots):
                assert not self._is_free[page], f"page {page} is both free and owned"
                assert not seen[page], f"page {page} owned twice"
                seen[page] = 1
        num_owned = sum(seen)
        assert num_owned + len(self._free_pages) == self.num_pages, (
            f"leaked pages: {self.num_pages} total, {len(self._free_pages)} free, {num_owned} owned"
        )


KV_SCALE_BYTES = 4  # an int8 pool's row of a head: its codes, then this many bytes of fp32 scale


class KVPool:
    """Per-layer K and V tensors of shape ``[num_slots, num_kv_heads, row_dim]``: ``row_dim`` is
    ``head_dim`` in ``dtype``, or with ``quantize`` (``--kv-cache-dtype int8``) ``head_dim +
    KV_SCALE_BYTES`` int8: each token's K or V of one head as int8 codes, then its fp32 scale's
    bytes. Whatever copies rows (the host and disk tiers, transfers, pulls, a tensor-parallel
    node's ranks) carries the codes and scales together, and a row's bytes are the same
    wherever it was computed (``quantize`` depends on the row's values alone)."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        zeroed: bool = True,
        quantize: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        # ``zeroed`` False: torch.empty, whose pages become resident only as slots are written
        # (a pool nothing reads before writing, like a TP node's staging pool).
        # ``quantize``: [n, num_kv_heads, head_dim] in ``dtype`` -> int8 rows [n,
        # num_kv_heads, head_dim + KV_SCALE_BYTES] (pd.executor.cpu_attention.quantize)
        self.quantize = quantize
        self.compute_dtype = dtype  # what the model writes and attention returns
        self.dtype = torch.int8 if quantize is not None else dtype  # what the pool holds
        self.row_dim = head_dim + KV_SCALE_BYTES if quantize is not None else head_dim
        shape = (num_slots, num_kv_heads, self.row_dim)
        new = torch.zeros if zeroed else torch.empty
        self.k = [new(shape, dtype=self.dtype, device=device) for _ in range(num_layers)]
        self.v = [new(shape, dtype=self.dtype, device=device) for _ in range(num_layers)]
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)

    @property
    def is_quantized(self) -> bool:
        return self.quantize is not None

    @property
    def kv_format(self) -> str:
        """What a row's bytes mean: the dtype, or ``int8/`` and the dtype its codes came from
        (a disk chunk's key and a transfer's check name it)."""
        name = str(self.compute_dtype).removeprefix("torch.")
        return f"int8/{name}" if self.is_quantized else name

    @property
    def num_bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.row_dim * elem

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # slots: [n] int64; k, v: [n, num_kv_heads, head_dim] in compute_dtype
        if self.quantize is not None:
            k, v = self.quantize(k), self.quantize(v)
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)
