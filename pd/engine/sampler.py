"""Turn the last-token logits of a batch into next tokens, one SamplingParams per row.

A row whose sampling fails (say, a distribution with no finite probability, or a logit_bias
token outside the model's vocabulary) fails alone: its request gets the error, the other rows
of the batch their tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from pd.core.sampling_params import SamplingParams


class SampledRow(NamedTuple):
    token: int  # -1 when ``error`` is set
    error: str | None = None


def make_generator(params: SamplingParams, fallback_seed: int) -> torch.Generator | None:
    """A per-request RNG: seeded requests are reproducible; greedy ones need none."""
    if params.is_greedy:
        return None
    gen = torch.Generator()
    gen.manual_seed(params.seed if params.seed is not None else fallback_seed)
    return gen


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    banned: Sequence[frozenset[int]] = (),
) -> list[SampledRow]:
    """logits: [R, vocab] float32 -> R sampled rows; ``banned[r]``: ids row r must not sample
    (e.g. EOS before ``min_tokens``)."""
    logits, bias_errors = _apply_logit_bias(logits, params)
    if any(banned):
        logits = logits.clone()
        vocab = logits.shape[-1]
        for r, ids in enumerate(banned):
            if ids:
                logits[r, [t for t in ids if t < vocab]] = float("-inf")
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for r, p in enumerate(params):
        if r in bias_errors:
            out.append(SampledRow(-1, bias_errors[r]))
        elif p.is_greedy:
            out.append(SampledRow(greedy[r]))
        else:
            try:
                out.append(SampledRow(_sample_row(logits[r], p, generators[r])))
            except (RuntimeError, ValueError) as e:  # e.g. no finite probability left
                out.append(SampledRow(-1, f"sampling failed: {e}"))
    return out


def _apply_logit_bias(
    logits: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, dict[int, str]]:
    """Logits with each row's logit_bias added (a copy, only when some row has one), and the
    rows whose bias names a token outside the vocabulary."""
    rows = [r for r, p in enumerate(params) if p.logit_bias]
    errors: dict[int, str] = {}
    if not rows:
        return logits, errors
    logits = logits.clone()
    vocab = logits.shape[-1]
    for r in rows:
        bias = params[r].logit_bias
        if bias[-1][0] >= vocab:  # sorted by token id: the last is the largest
            errors[r] = f"logit_bias token {bias[-1][0]} outside the vocabulary [0, {vocab})"
            continue
        # ids, values: [num_biased]
        ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=logits.device)
        values = torch.tensor([b for _, b in bias], dtype=logits.dtype, device=logits.device)
        logits[r].index_add_(0, ids, values)
    return logits, errors


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    # logits: [vocab]
    logits = logits.float().cpu() / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[0]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # drop a token once the mass before it already reaches top_p (the top-1 always stays)
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=gen).item())
