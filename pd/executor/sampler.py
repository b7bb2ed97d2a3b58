"""Turn the last-token logits of a batch into next tokens, one SamplingParams per row.

Each row goes through the same fixed steps, in vLLM's order:

1. ``process_logits``, the per-request logits processing (greedy too): ``logit_bias`` added,
   the penalties applied (``pd.executor.penalties``), then ``banned`` ids (min_tokens) set to
   -inf (vLLM bans before the penalties: the same, a penalty keeps -inf at -inf), and the
   tokens its grammar does not allow (``masks``, ``pd.executor.grammar``) set to -inf.
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
from pd.executor.grammar import apply_masks_
from pd.executor.penalties import TokenCounts, apply_penalties_

# What a logprob of -inf (a banned token) is sent as: JSON has no infinity (vLLM sends the same)
MIN_LOGPROB = -9999.0


class SampledRow(NamedTuple):
    token: int  # -1 when ``error`` is set
    error: str | None = None
    accepted: tuple[int, ...] = ()  # draft tokens accepted before ``token`` (speculation)
    # with ``params.logprobs`` set: one per token of (*accepted, token)
    logprobs: tuple[TokenLogprobsMsg, ...] = ()
    is_refused: bool = False  # ``error`` is the request's own (its grammar): a 400


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
    masks: Sequence[torch.Tensor | None] = (),
) -> list[SampledRow]:
    """logits: [R, vocab] float32 -> R sampled rows; ``banned[r]``: ids row r must not sample
    (e.g. EOS before ``min_tokens``); ``counts[r]``: row r's token counts, for its penalties
    (None, or no entry: it has none); ``masks[r]``: row r's grammar bitmask, [ceil(vocab / 32)]
    int32 (None, or no entry: it has no grammar)."""
    logits, errors = _processed(logits, params, banned, counts, masks)
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
        out.append(SampledRow(token))
    # the rows that asked for logprobs, in one call: a few ops for the batch, not a few a row
    want = [r for r, row in enumerate(out) if row.error is None and params[r].logprobs is not None]
    if want:
        lps = token_logprobs(logits[want], [out[r].token for r in want], [params[r] for r in want])
        for r, lp in zip(want, lps):
            out[r] = out[r]._replace(logprobs=(lp,))
    return out


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    counts: TokenCounts | None = None,
    draft: Sequence[int] = (),
) -> torch.Tensor:
    """The per-request logits processing of one request's rows (step 1 of the module
    docstring, less ``banned``): logits [len(draft) + 1, vocab] -> a float32 copy with
    ``logit_bias`` added and the penalties applied, row i counting ``draft[:i]`` as output
    (what speculative verification needs: each position as if the draft before it was
    accepted). Raises ValueError for a biased token outside the vocabulary."""
    out = logits.float().clone()
    process_logits_(out, params, counts, draft)
    return out


def process_logits_(
    logits: torch.Tensor,
    params: SamplingParams,
    counts: TokenCounts | None = None,
    draft: Sequence[int] = (),
) -> None:
    """``process_logits`` in place, on float32 logits the caller owns (a batch's copy): no
    tensor of the vocabulary's size is made. ValueError, logits untouched, for a biased token
    outside the vocabulary."""
    bias = params.logit_bias
    if bias:
        vocab = logits.shape[-1]
        if bias[-1][0] >= vocab:  # sorted by token id: the last is the largest
            raise ValueError(f"logit_bias token {bias[-1][0]} outside the vocabulary [0, {vocab})")
        ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=logits.device)
        values = torch.tensor([b for _, b in bias], dtype=logits.dtype, device=logits.device)
        logits[..., ids] += values
    if counts is not None:
        apply_penalties_(logits, *counts.rows(draft), params)


def token_logprobs(
    logits: torch.Tensor,
    tokens: Sequence[int],
    params: SamplingParams | Sequence[SamplingParams],
) -> tuple[TokenLogprobsMsg, ...]:
    """logits: [n, vocab], processed (``process_logits``) -> for each row i the logprob of
    ``tokens[i]`` and the ``logprobs`` most likely tokens of row i's params (one params for
    every row, or one each), under the distribution it was drawn from before the cuts:
    log-softmax of logits / temperature (1 for greedy). Every op works row by row, so a row's
    numbers do not depend on the others."""
    num_rows = len(tokens)
    plist = [params] * num_rows if isinstance(params, SamplingParams) else list(params)
    temps = [p.temperature if p.temperature >= MIN_TEMPERATURE else 1.0 for p in plist]
    # lp: [n, vocab]
    lp = torch.log_softmax(logits.float().cpu() / torch.tensor(temps)[:, None], dim=-1)
    chosen = lp[torch.arange(num_rows), torch.tensor(list(tokens))].tolist()
    num_top = max(p.logprobs or 0 for p in plist)
    top_ids: list[list[int]] = [[] for _ in range(num_rows)]
    top_lps: list[list[float]] = [[] for _ in range(num_rows)]
    if num_top:
        top = torch.topk(lp, num_top, dim=-1)  # sorted: each row's first k are its top k
        top_ids, top_lps = top.indices.tolist(), top.values.tolist()
    return tuple(
        TokenLogprobsMsg(
            token,
            max(value, MIN_LOGPROB),
            top_ids[i][: p.logprobs or 0],
            [max(v, MIN_LOGPROB) for v in top_lps[i][: p.logprobs or 0]],
        )
        for i, (token, value, p) in enumerate(zip(tokens, chosen, plist))
    )


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
    masks: Sequence[torch.Tensor | None] = (),
) -> tuple[torch.Tensor, dict[int, str]]:
    """The batch's logits with each row processed (``process_logits``, then its ``banned`` ids
    and what its grammar's mask rules out at -inf): a copy, only when some row needs it; and
    the rows that fail: a logit_bias token outside the vocabulary, or no token left to sample
    under a grammar."""
    banned = list(banned) + [frozenset()] * (len(params) - len(banned))
    counts = list(counts) + [None] * (len(params) - len(counts))
    masks = list(masks) + [None] * (len(params) - len(masks))
    guided = [r for r in range(len(params)) if masks[r] is not None]
    rows = [r for r, p in enumerate(params) if p.logit_bias or banned[r] or counts[r] is not None]
    errors: dict[int, str] = {}
    if not rows and not guided:
        return logits, errors
    logits = logits.float().clone()
    vocab = logits.shape[-1]
    for r in rows:
        try:
            process_logits_(logits[r : r + 1], params[r], counts[r])  # a view of the copy
        except ValueError as e:
            errors[r] = str(e)
            continue
        if banned[r]:
            logits[r, [t for t in banned[r] if t < vocab]] = float("-inf")
    if guided:  # the batch's guided rows at once
        sub = logits[guided]  # [g, vocab], a copy
        apply_masks_(sub, torch.stack([masks[r] for r in guided]))  # type: ignore[misc]
        logits[guided] = sub
        for r, top in zip(guided, sub.amax(dim=-1).tolist()):
            if top == float("-inf") and r not in errors:
                errors[r] = (
                    "the grammar allows no token the request may sample here (min_tokens or "
                    "stop_token_ids ban every token it allows)"
                )
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
