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
    """One request's prompt tokens and output counts, kept up to date with its output as it
    grows (only the new tokens are counted at each step). Sparse: a step's penalties touch
    only the tokens seen, never a tensor of the vocabulary's size."""

    def __init__(self, prompt_ids: Sequence[int], vocab: int) -> None:
        self.vocab = vocab
        self.prompt_ids = torch.unique(torch.tensor(list(prompt_ids), dtype=torch.long))
        self.counts: dict[int, int] = {}  # output token -> times it is in the output
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
        for token in output_ids[self.num_counted :]:
            self.counts[token] = self.counts.get(token, 0) + 1
        self.num_counted = len(output_ids)

    def rows(self, extra: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, seen, counts) for len(extra) + 1 positions, over the m tokens seen in the
        prompt, the output or ``extra``: row i also counts ``extra[:i]`` (draft tokens that
        would be accepted before position i). ids: [m] sorted; seen: [n, m] bool (in the
        prompt or counted); counts: [n, m] float32."""
        out_ids = torch.tensor(list(self.counts), dtype=torch.long)
        out_counts = torch.tensor(list(self.counts.values()), dtype=torch.float32)
        ext = torch.tensor(list(extra), dtype=torch.long)
        ids = torch.unique(torch.cat([self.prompt_ids, out_ids, ext]))
        counts = torch.zeros(len(extra) + 1, ids.shape[0])
        counts[:, torch.searchsorted(ids, out_ids)] += out_counts
        for i, pos in enumerate(torch.searchsorted(ids, ext).tolist()):
            counts[i + 1 :, pos] += 1
        in_prompt = torch.isin(ids, self.prompt_ids)
        return ids, in_prompt | (counts > 0), counts


def apply_penalties_(
    logits: torch.Tensor,
    ids: torch.Tensor,
    seen: torch.Tensor,
    counts: torch.Tensor,
    params: SamplingParams,
) -> None:
    """Penalise logits [n, vocab] float32 in place (the module docstring's formulas, in vLLM's
    order: repetition, frequency, presence), touching only the m seen tokens. ids, seen,
    counts: ``TokenCounts.rows``."""
    sub = logits[:, ids]  # [n, m], a copy: the only logits a penalty changes
    r = params.repetition_penalty
    if r != 1.0:
        # vLLM multiplies by 1 / r (not divides by r): the same rounding as its kernel
        sub = torch.where(seen, torch.where(sub > 0, sub * (1.0 / r), sub * r), sub)
    if params.frequency_penalty != 0.0:
        sub = sub - params.frequency_penalty * counts
    if params.presence_penalty != 0.0:
        sub = sub - params.presence_penalty * (counts > 0).float()
    logits[:, ids] = sub
