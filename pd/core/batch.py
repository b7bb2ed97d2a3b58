"""``ForwardBatch``: the flat token layout that one ``DecoderLM.forward`` runs.

A batch mixes extend requests (new tokens attending to a prefix already in slots; a cold
prefill is an extend with an empty prefix) and decode requests (one new token). Request r owns
the flat token range ``[q_start[r], q_start[r+1])``:

    request   prefix (in slots)      new tokens (this batch)
    r         positions [0, p_r)     positions [p_r, s_r)   s_r = seq_len, s_r - p_r = extend_len
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch


class SeqInput(NamedTuple):
    """One request's part of a batch."""

    new_token_ids: Sequence[int]  # the tokens to compute now
    slots: Sequence[int]  # KV slots of every token up to and including the new ones
    num_prefix: int  # tokens already in slots, before the new ones


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64: where each new token's K/V is written
    kv_slots: list[torch.Tensor]  # per request: [seq_len] int64, the slots it attends to
    extend_lens: list[int]
    seq_lens: list[int]
    logits_indices: torch.Tensor | None  # [R] flat index of each request's last token; None: all
    attn_metadata: Any = field(default=None, repr=False)  # set by the attention backend
    # called with i once layer i's K/V of the new tokens are in the pool (e.g. to send them)
    on_layer_done: Callable[[int], None] | None = field(default=None, repr=False)

    @classmethod
    def build(
        cls,
        seqs: Sequence[SeqInput],
        device: torch.device | str = "cpu",
        *,
        return_all_logits: bool = False,
    ) -> ForwardBatch:
        if not seqs:
            raise ValueError("empty batch")
        ids: list[int] = []
        positions: list[int] = []
        out_slots: list[int] = []
        kv_slots: list[torch.Tensor] = []
        extend_lens: list[int] = []
        seq_lens: list[int] = []
        for new_ids, slots, num_prefix in seqs:
            n = len(new_ids)
            seq_len = num_prefix + n
            assert n >= 1, "every request in a batch computes at least one token"
            assert len(slots) == seq_len, f"{len(slots)} slots for {seq_len} tokens"
            ids.extend(new_ids)
            positions.extend(range(num_prefix, seq_len))
            out_slots.extend(slots[num_prefix:])
            kv_slots.append(torch.tensor(slots, dtype=torch.int64, device=device))
            extend_lens.append(n)
            seq_lens.append(seq_len)
        last = torch.tensor(extend_lens, dtype=torch.int64).cumsum(0) - 1
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            out_slots=torch.tensor(out_slots, dtype=torch.int64, device=device),
            kv_slots=kv_slots,
            extend_lens=extend_lens,
            seq_lens=seq_lens,
            logits_indices=None if return_all_logits else last.to(device),
        )

    @property
    def num_reqs(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


class DecodeBatch(NamedTuple):
    """One new token per row, padded to ``num_rows`` rows: the fixed-shape input of a compiled
    decode step (``pd.executor.graphs``). Row r < len(seqs) is request r; a padding row writes
    and reads only ``scratch_slot``, a pool slot no request is ever given. The key length L
    (the longest request's) is the one dimension that changes from step to step."""

    input_ids: torch.Tensor  # [num_rows] int64
    positions: torch.Tensor  # [num_rows] int64
    out_slots: torch.Tensor  # [num_rows] int64: where each row's new K/V is written
    kv_idx: torch.Tensor  # [num_rows, L] int64: the slot of each key, padded with scratch_slot
    kv_mask: torch.Tensor  # [num_rows, L] bool: True where the key is the row's own
    # what ``DecoderLM.forward`` reads of a ForwardBatch: no per-layer hook, all logits
    on_layer_done: None = None
    logits_indices: None = None

    @classmethod
    def build(
        cls,
        seqs: Sequence[SeqInput],
        num_rows: int,
        scratch_slot: int,
        device: torch.device | str = "cpu",
    ) -> DecodeBatch:
        if not 0 < len(seqs) <= num_rows:
            raise ValueError(f"{len(seqs)} decode rows for a batch of {num_rows}")
        max_len = max(len(s.slots) for s in seqs)
        idx = torch.full((num_rows, max_len), scratch_slot, dtype=torch.int64)
        mask = torch.zeros(num_rows, max_len, dtype=torch.bool)
        mask[len(seqs) :, 0] = True  # a padding row attends to its scratch key alone
        ids = [0] * num_rows
        positions = [0] * num_rows
        out_slots = [scratch_slot] * num_rows
        for r, (new_ids, slots, num_prefix) in enumerate(seqs):
            assert len(new_ids) == 1 and len(slots) == num_prefix + 1, "one new token per row"
            idx[r, : len(slots)] = torch.tensor(slots, dtype=torch.int64)
            mask[r, : len(slots)] = True
            ids[r], positions[r], out_slots[r] = new_ids[0], num_prefix, slots[-1]
        return cls(
            torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            torch.tensor(out_slots, dtype=torch.int64, device=device),
            idx.to(device),
            mask.to(device),
        )
