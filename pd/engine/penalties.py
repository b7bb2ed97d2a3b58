"""Presence, frequency and repetition penalties (vLLM's definitions) and the token counts they
need.

For a request with penalties, with ``seen`` the tokens of its prompt or its output so far and
``count[t]`` the times token t is in its output:

    logit[t] *= 1 / r   if t in seen and logit[t] > 0     (repetition_penalty r)
    logit[t] *= r       if t in seen and logit[t] <= 0
    logit[t] -= f * count[t]                              (frequency_penalty f)
    logit[t] -= p       if count[t] > 0                   (presence_penalty p)

The counts are rebuilt from the request's own tokens (``Req.prompt_ids`` and ``output_ids``),
which every node has: the decode node gets the prompt in ``DecodeReqMsg`` and the first token
in ``PrefilledMsg``, so nothing more travels. Every operation is elementwise: a row's result
does not depend on its batch (the deterministic path stays so).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pd.core.request import Req
from pd.core.sampling_params import SamplingParams


class TokenCounts:
    """One request's ``seen`` mask and output counts over the vocabulary, kept up to date with
    its output as it grows (only the new tokens are counted at each step)."""

    def __init__(self, prompt_ids: Sequence[int], vocab: int) -> None:
        self.vocab = vocab
        # prompt: [vocab] bool; counts: [vocab] int32, the output's tokens counted so far
        self.prompt = torch.zeros(vocab, dtype=torch.bool)
        self.prompt[torch.tensor(list(prompt_ids), dtype=torch.long)] = True
        self.counts = torch.zeros(vocab, dtype=torch.int32)
        self.num_counted = 0  # leading output tokens in ``counts``

    @classmethod
    def of(cls, req: Req, vocab: int) -> TokenCounts | None:
        """``req``'s counts, up to date with its output (kept on the request), or None when its
        params have no penalty."""
        if not req.params.has_penalties:
            return None
        counts = req.token_counts
        if not isinstance(counts, TokenCounts) or counts.vocab != vocab:
            counts = req.token_counts = cls(req.prompt_ids, vocab)
        counts.sync(req.output_ids)
        return counts

    def sync(self, output_ids: Sequence[int]) -> None:
        """Count the output tokens past those already counted (an output only grows)."""
        assert len(output_ids) >= self.num_counted, (len(output_ids), self.num_counted)
        new = output_ids[self.num_counted :]
        if new:
            ones = torch.ones(len(new), dtype=torch.int32)
            self.counts.index_add_(0, torch.tensor(list(new), dtype=torch.long), ones)
            self.num_counted = len(output_ids)

    def rows(self, extra: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen, counts) for len(extra) + 1 positions: row i also counts ``extra[:i]`` (draft
        tokens that would be accepted before position i). seen: [n, vocab] bool, counts:
        [n, vocab] int32."""
        counts = self.counts.expand(len(extra) + 1, self.vocab).clone()
        for i, token in enumerate(extra):
            counts[i + 1 :, token] += 1
        return self.prompt | (counts > 0), counts


def apply_penalties(
    logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, params: SamplingParams
) -> torch.Tensor:
    """logits: [n, vocab] float32 -> a penalised copy (the module docstring's formulas, in
    vLLM's order: repetition, frequency, presence). seen, counts: [n, vocab] (``rows``)."""
    logits = logits.float().clone()
    r = params.repetition_penalty
    if r != 1.0:
        # vLLM multiplies by 1 / r (not divides by r): the same rounding as its kernel
        scale = torch.where(
            logits > 0, torch.full_like(logits, 1.0 / r), torch.full_like(logits, r)
        )
        logits = torch.where(seen, logits * scale, logits)
    if params.frequency_penalty != 0.0:
        logits -= params.frequency_penalty * counts.float()
    if params.presence_penalty != 0.0:
        logits -= params.presence_penalty * (counts > 0).float()
    return logits
