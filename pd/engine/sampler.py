"""Turn the last-token logits of a batch into next tokens, one SamplingParams per row.

Each row goes through the same fixed steps, in vLLM's order:

1. ``process_logits``, the per-request logits processing (greedy too): ``logit_bias`` added,
   ``banned`` ids (min_tokens) set to -inf, penalties applied (``pd.engine.penalties``). A
   later per-request mask (a grammar's) joins here.
2. Greedy: the argmax. Sampled: ``probs_from_logits``: divided by the temperature, cut by
   min_p, top_k, then top_p; one draw (``draw``).
3. With ``params.logprobs`` set, ``token_logprobs``: the log-softmax of step 1's logits
   divided by the temperature (1 for greedy), before step 2's cuts.

A row whose sampling fails (say, a distribution with no finite probability, or a logit_bias
token outside the model's vocabulary) fails alone: its request gets the error, the other rows
of the batch their tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from pd.core.messages import TokenLogprobsMsg
from pd.core.sampling_params import MIN_TEMPERATURE, SamplingParams
from pd.engine.penalties import TokenCounts, apply_penalties

# What a logprob of -inf (a banned token) is sent as: JSON has no infinity (vLLM sends the same)
MIN_LOGPROB = -9999.0


class SampledRow(NamedTuple):
    token: int  # -1 when ``error`` is set
    error: str | None = None
    accepted: tuple[int, ...] = ()  # draft tokens accepted before ``token`` (speculation)
    # with ``params.logprobs`` set: one per token of (*accepted, token)
    logprobs: tuple[TokenLogprobsMsg, ...] = ()


def make_generator(params: SamplingParams, fallback_seed: int) -> torch.Generator | None:
    """A per-request RNG: seeded requests are reproducible; greedy ones need none."""
    if params.is_greedy:
        return None
    gen = torch.Generator()
    gen.manual_seed(params.seed if params.seed is not None else fallback_seed)
    return gen


def skip_draws(gen: torch.Generator | None, num_tokens: int) -> None:
    """Advance ``gen`` past the draws of ``num_tokens`` tokens sampled elsewhere (a decode
    node's copy of a request, past the first token its prefill node drew): one draw a token
    (``draw``), so a seeded request draws the same stream as in one engine."""
    if gen is not None:
        for _ in range(num_tokens):
            torch.rand(1, generator=gen, dtype=torch.float64)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    banned: Sequence[frozenset[int]] = (),
    counts: Sequence[TokenCounts | None] = (),
) -> list[SampledRow]:
    """logits: [R, vocab] float32 -> R sampled rows; ``banned[r]``: ids row r must not sample
    (e.g. EOS before ``min_tokens``); ``counts[r]``: row r's token counts, for its penalties
    (None, or no entry: it has none)."""
    logits, errors = _processed(logits, params, banned, counts)
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for r, p in enumerate(params):
        if r in errors:
            out.append(SampledRow(-1, errors[r]))
            continue
        try:
            token = greedy[r] if p.is_greedy else _sample_row(logits[r], p, generators[r])
        except (RuntimeError, ValueError) as e:  # e.g. no finite probability left
            out.append(SampledRow(-1, f"sampling failed: {e}"))
            continue
        lps = token_logprobs(logits[r : r + 1], [token], p) if p.logprobs is not None else ()
        out.append(SampledRow(token, logprobs=lps))
    return out


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    counts: TokenCounts | None = None,
    draft: Sequence[int] = (),
) -> torch.Tensor:
    """The per-request logits processing of one request's rows (step 1 of the module
    docstring, less ``banned``): logits [len(draft) + 1, vocab] -> a copy with ``logit_bias``
    added and the penalties applied, row i counting ``draft[:i]`` as output (what speculative
    verification needs: each position as if the draft before it was accepted). Raises
    ValueError for a biased token outside the vocabulary."""
    logits = add_logit_bias(logits, params)
    if counts is not None:
        logits = apply_penalties(logits, *counts.rows(draft), params)
    return logits


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], params: SamplingParams
) -> tuple[TokenLogprobsMsg, ...]:
    """logits: [n, vocab], processed (``process_logits``) -> for each row i the logprob of
    ``tokens[i]`` and the ``params.logprobs`` most likely tokens, under the distribution it
    was drawn from before the cuts: log-softmax of logits / temperature (1 for greedy). Each
    row alone, so its numbers do not depend on the batch."""
    num_top = params.logprobs or 0
    temperature = params.temperature if params.temperature >= MIN_TEMPERATURE else 1.0
    out = []
    for i, token in enumerate(tokens):
        # lp: [vocab]
        lp = torch.log_softmax(logits[i].float().cpu() / temperature, dim=-1)
        top = torch.topk(lp, num_top) if num_top else None
        out.append(
            TokenLogprobsMsg(
                token,
                max(float(lp[token]), MIN_LOGPROB),
                top.indices.tolist() if top is not None else [],
                [max(v, MIN_LOGPROB) for v in top.values.tolist()] if top is not None else [],
            )
        )
    return tuple(out)


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
    each row summing to 1: divided by the temperature, cut to the tokens of at least min_p x
    the top token's probability, to the top_k logits, then to the top_p mass (vLLM's order).
    Not for greedy params (a zero temperature cannot divide)."""
    logits = logits.float().cpu() / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * params.min_p
        logits = logits.masked_fill(probs < floor, float("-inf"))
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


def _processed(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    banned: Sequence[frozenset[int]],
    counts: Sequence[TokenCounts | None],
) -> tuple[torch.Tensor, dict[int, str]]:
    """The batch's logits with each row processed (``process_logits``, then its ``banned`` ids
    at -inf): a copy, only when some row needs it; and the rows whose logit_bias names a token
    outside the vocabulary."""
    banned = list(banned) + [frozenset()] * (len(params) - len(banned))
    counts = list(counts) + [None] * (len(params) - len(counts))
    rows = [r for r, p in enumerate(params) if p.logit_bias or banned[r] or counts[r] is not None]
    errors: dict[int, str] = {}
    if not rows:
        return logits, errors
    logits = logits.clone()
    vocab = logits.shape[-1]
    for r in rows:
        try:
            logits[r] = process_logits(logits[r : r + 1], params[r], counts[r])[0]
        except ValueError as e:
            errors[r] = str(e)
            continue
        if banned[r]:
            logits[r, [t for t in banned[r] if t < vocab]] = float("-inf")
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
