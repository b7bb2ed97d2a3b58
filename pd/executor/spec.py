"""N-gram speculative decoding (prompt lookup, vLLM's "ngram", SGLang's NGRAM): guess the next
tokens from the request's own text, then check the guesses against one forward pass.

``propose`` finds the longest recent n-gram that also ends the sequence and drafts the tokens
that followed it; ``verify`` takes the target model's logits at the draft's positions and
returns the tokens to append. Greedy verification appends exactly what greedy decoding would;
sampled verification draws each position as ``sample`` would, and keeps the draft while the
draws agree with it, so a seeded request gets the very tokens it gets without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pd.core.sampling_params import SamplingParams
from pd.executor.grammar import apply_masks_
from pd.executor.penalties import TokenCounts
from pd.executor.sampler import SampledRow, draw, probs_from_logits, process_logits, token_logprobs


def propose(tokens: Sequence[int], k: int, *, max_ngram: int = 4, min_ngram: int = 2) -> list[int]:
    """Up to ``k`` draft tokens to follow ``tokens``, or [] when nothing matches.

    The rule: for n from ``max_ngram`` down to ``min_ngram``, the key is the last n tokens; its
    most recent earlier occurrence (one that ends before the last token, so never the suffix
    itself; it may overlap the suffix) supplies the draft: the up to k tokens that followed it,
    fewer where the sequence ends. The first n with an occurrence wins.

    One reversed scan does every n at once: each earlier position holding the last token is a
    candidate, the length of its match with the suffix is counted backwards (capped at
    ``max_ngram``), and the most recent candidate with the longest match wins; a match of
    ``max_ngram`` ends the scan.
    """
    if min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
    num_tokens = len(tokens)
    max_n = min(max_ngram, num_tokens - 1)  # an earlier occurrence must end before the last
    if k <= 0 or max_n < min_ngram:
        return []
    rev = list(reversed(tokens))  # rev[j] is tokens[num_tokens - 1 - j]
    best_n, best_j = 0, 0
    j = 0
    while best_n < max_n:
        try:
            j = rev.index(rev[0], j + 1)  # the next earlier position holding the last token
        except ValueError:
            break
        n = 1
        while n < max_n and j + n < num_tokens and rev[j + n] == rev[n]:
            n += 1
        if n > best_n:
            best_n, best_j = n, j
    if best_n < min_ngram:
        return []
    start = num_tokens - best_j  # just after the occurrence
    return list(tokens[start : start + k])


def verify(
    logits: torch.Tensor,
    draft: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    counts: TokenCounts | None = None,
) -> list[int]:
    """The tokens to append (1 to len(draft) + 1): the accepted prefix of ``draft``, then one
    token of the target's own (the correction at the first rejection, or the bonus token after
    a fully accepted draft).

    logits: [len(draft) + 1, vocab] float32; row i is the target's logits where draft[i] would
    go, row len(draft) the position after the whole draft. ``params.logit_bias`` and the
    penalties (``counts``: the request's token counts) apply as in ``sample``, row i's
    penalties counting draft[:i] as output, as plain decoding would once they are accepted;
    ``sample``'s ``banned`` (min_tokens) does not, so a caller holds back speculation until
    min_tokens is reached, and cuts the result at a stop token or max_tokens.

    Greedy: draft[i] is accepted while it is row i's argmax. Sampled: position i's token is
    drawn from p_i exactly as ``sample`` draws it (``sampler.draw``: the inverse CDF at one
    uniform draw of ``generator``), and draft[i] is accepted if the draw is draft[i]; at the
    first draw that differs, that draw is the token. This is speculative sampling's rule for a
    point-mass draft q = one-hot(draft[i]) (accept with probability p_i(draft[i]), else take a
    token from p_i with draft[i] removed), coupled to the draws plain decoding would make: one
    draw per token appended, none for the draft tokens never reached, so a seeded request gets
    the same tokens with or without speculation, whatever was drafted. Raises RuntimeError or
    ValueError where ``sample`` would fail the row (e.g. no finite probability).
    """
    return _accept(_processed(logits, draft, params, counts), draft, params, generator)


def verify_row(
    logits: torch.Tensor,
    draft: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    counts: TokenCounts | None = None,
    masks: torch.Tensor | None = None,
) -> SampledRow:
    """``verify``'s verdict as ``sample``'s row: the last token, the accepted draft before it,
    and (with ``params.logprobs``) each appended token's logprobs, from its position's
    processed logits; the row's error where ``sample`` would fail it. ``masks``: the grammar's
    bitmask of each position, [len(draft) + 1, ceil(vocab / 32)] int32
    (``grammar.Guide.fill_draft``: a draft the grammar accepts)."""
    try:
        processed = _processed(logits, draft, params, counts)
        if masks is not None:
            apply_masks_(processed, masks)
        tokens = _accept(processed, draft, params, generator)
    except (RuntimeError, ValueError) as e:  # as ``sample``: this request alone fails
        return SampledRow(-1, f"sampling failed: {e}")
    want = params.logprobs is not None  # row i is the position of tokens[i]
    lps = token_logprobs(processed[: len(tokens)], tokens, params) if want else ()
    return SampledRow(tokens[-1], None, tuple(tokens[:-1]), lps)


def _processed(
    logits: torch.Tensor,
    draft: Sequence[int],
    params: SamplingParams,
    counts: TokenCounts | None,
) -> torch.Tensor:
    num_draft = len(draft)
    assert logits.shape[0] == num_draft + 1, f"{logits.shape[0]} rows for {num_draft} drafts"
    assert all(0 <= t < logits.shape[-1] for t in draft), f"draft {draft} outside the vocabulary"
    return process_logits(logits, params, counts, draft)


def _accept(
    logits: torch.Tensor,
    draft: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator | None,
) -> list[int]:
    """``verify``'s rule on processed logits."""
    if params.is_greedy:
        best = logits.argmax(dim=-1).tolist()
        for i, t in enumerate(draft):
            if t != best[i]:
                return [*draft[:i], best[i]]
        return [*draft, best[-1]]  # every draft accepted: the bonus token
    probs = probs_from_logits(logits, params)  # [num_draft + 1, vocab]
    for i, t in enumerate(draft):
        token = draw(probs[i], generator)
        if token != t:
            return [*draft[:i], token]
    return [*draft, draw(probs[-1], generator)]
