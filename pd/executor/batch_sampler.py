"""A batch's sampling, in one place: from the logits of a forward to each request's
``SampledRow``, with its grammar's mask, its penalties, and (a request with a draft) the
speculative verdict on the draft (``pd.executor.spec``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pd.core.request import Req
from pd.executor.grammar import Guide, allocate_masks
from pd.executor.penalties import TokenCounts
from pd.executor.sampler import SampledRow, sample
from pd.executor.spec import verify_row


class BatchSampler:
    """Samples the rows of a forward (a guided request's grammar compiled before it was
    scheduled: ``pd.executor.grammar.GrammarCompiler``)."""

    def sample(
        self,
        logits: torch.Tensor,
        reqs: Sequence[Req],
        banned: Sequence[frozenset[int]] = (),
        drafts: Sequence[Sequence[int]] = (),
    ) -> list[SampledRow]:
        """Each request's next token (``banned``: per request, ids it must not sample; a request
        with a grammar samples only what it allows).

        ``drafts[i]`` (for the first len(drafts) requests, decoding ones): tokens guessed to
        follow request i, which then has 1 + len(drafts[i]) rows in ``logits`` (its last
        token, then each draft token); its row is ``spec.verify``'s verdict on them (on the
        draft's prefix its grammar accepts)."""
        vocab = logits.shape[-1]
        counts = [TokenCounts.of(r, vocab) for r in reqs]  # None: no penalties
        guides, failed = self._guides(reqs)
        if not any(drafts):
            params, gens = [r.params for r in reqs], [r.generator for r in reqs]
            masks = grammar_masks(guides, vocab)
            return _with_failed(sample(logits, params, gens, banned, counts, masks), failed)
        verdicts: dict[int, SampledRow] = {}
        plain: list[int] = []  # the requests sampled as usual ...
        last_rows: list[int] = []  # ... and the logits row of each
        row = 0
        for i, req in enumerate(reqs):
            draft = drafts[i] if i < len(drafts) else ()
            guide = guides[i]
            if draft and guide is not None:
                draft_masks = allocate_masks(len(draft) + 1, vocab)
                kept = guide.fill_draft(draft, draft_masks, 0)
                rows = logits[row : row + len(kept) + 1]
                verdicts[i] = verify_row(
                    rows, kept, req.params, req.generator, counts[i], draft_masks[: len(kept) + 1]
                )
            elif draft:
                rows = logits[row : row + len(draft) + 1]
                verdicts[i] = verify_row(rows, draft, req.params, req.generator, counts[i])
            else:
                plain.append(i)
                last_rows.append(row)
            row += len(draft) + 1
        sampled = iter(
            sample(
                logits[last_rows],
                [reqs[i].params for i in plain],
                [reqs[i].generator for i in plain],
                [banned[i] for i in plain] if banned else (),
                [counts[i] for i in plain],
                grammar_masks([guides[i] for i in plain], vocab),
            )
        )
        rows_out = [verdicts[i] if i in verdicts else next(sampled) for i in range(len(reqs))]
        return _with_failed(rows_out, failed)

    def _guides(self, reqs: Sequence[Req]) -> tuple[list[Guide | None], dict[int, str]]:
        """Each request's grammar guide, up to date with its output (None: no grammar), and the
        requests whose grammar failed (it was refused here, or the output broke it)."""
        guides: list[Guide | None] = []
        failed: dict[int, str] = {}
        for i, req in enumerate(reqs):
            try:
                guides.append(Guide.of(req))
            except ValueError as e:
                guides.append(None)
                failed[i] = str(e)
        return guides, failed


def grammar_masks(guides: Sequence[Guide | None], vocab: int) -> list[torch.Tensor | None]:
    """Each guided row's bitmask of the tokens its grammar allows next (None elsewhere)."""
    if all(g is None for g in guides):
        return []
    masks = allocate_masks(len(guides), vocab)
    for r, guide in enumerate(guides):
        if guide is not None:
            guide.fill(masks, r)
    return [masks[r] if g is not None else None for r, g in enumerate(guides)]


def _with_failed(rows: list[SampledRow], failed: dict[int, str]) -> list[SampledRow]:
    """``rows`` with the rows of the requests whose grammar failed replaced by their error (the
    request's own fault: ``is_refused``)."""
    for i, error in failed.items():
        rows[i] = SampledRow(-1, error, is_refused=True)
    return rows
