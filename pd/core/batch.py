"""``ForwardBatch``: the flat token layout that one ``forward_batch`` call runs.

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
