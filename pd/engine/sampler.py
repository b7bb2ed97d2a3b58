"""Turn the last-token logits of a batch into next tokens, one SamplingParams per row.

A row whose sampling fails (say, a distribution with no finite probability, or a logit_bias
token outside the model's vocabulary) fails alone: its request gets the error, the other rows
of the batch their tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from pd.core.sampling_params import SamplingParams


class SampledRow(NamedTuple):
    token: int  # -1 when ``error`` is set
    error: str | None = None
    accepted: tuple[int, ...] = ()  # draft tokens accepted before ``token`` (speculation)


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


def add_logit_bias(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [..., vocab] with ``params.logit_bias`` added to every row: a copy, or the same
    tensor when there is no bias. Raises ValueError for a biased token outside the vocabulary."""
    bias = params.logit_bias
    if not bias:
        return logits
    vocab = logits.shape[-1]
    if bias[-1][0] >= vocab:  # sorted by token id: the last is the largest
        raise ValueError(f"logit_bias token {bias[-1][0]} outside the vocabulary [0, {vocab})")
    # ids, values: [num_biased]; ids are unique (SamplingParams checks)
    ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=logits.device)
    values = torch.tensor([b for _, b in bias], dtype=logits.dtype, device=logits.device)
    logits = logits.clone()
    logits[..., ids] += values
    return logits


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [..., vocab] -> the distribution to sample from, [..., vocab] float32 on the CPU,
    each row summing to 1: divided by the temperature, cut to the top_k logits, then to the
    top_p mass. Not for greedy params (a zero temperature cannot divide)."""
    logits = logits.float().cpu() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # drop a token once the mass before it already reaches top_p (the top-1 always stays)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)  # each row sums to 1, as promised
    return probs


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
    for r in rows:
        try:
            logits[r] = add_logit_bias(logits[r], params[r])
        except ValueError as e:
            errors[r] = str(e)
    return logits, errors


def draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One token from ``probs`` [vocab] by its inverse CDF at one uniform draw of ``gen``.

    One draw per token, whatever the position: speculative verification (``spec.verify``)
    draws each position the same way, so a seeded request samples the same tokens with or
    without speculation, whatever its drafts. ValueError if no token has a probability."""
    cdf = probs.double().cumsum(0)  # double: the last entries keep their mass apart
    total = float(cdf[-1])
    if not math.isfinite(total) or total <= 0.0:
        raise ValueError(f"no token has a finite probability (total {total})")
    u = torch.rand(1, generator=gen, dtype=torch.float64) * total
    # the first index whose cumulative mass passes u: a token of zero probability never is
    return int(torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[0] - 1))


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    # logits: [vocab]
    return draw(probs_from_logits(logits, p), gen)
