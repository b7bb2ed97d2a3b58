"""Structured outputs: a request's grammar (``SamplingParams.grammar``: an llguidance grammar,
e.g. a JSON schema's) masks the tokens it may sample, wherever one is sampled.

1. The server compiles the grammar before admission (``grammar_error``): a grammar llguidance
   refuses is a 400 that says why, never a failed request on a node.
2. The grammar travels as text inside the request's ``SamplingParams``; each engine (colocated,
   prefill node, decode node) builds the request's ``Guide`` from it the first time the request
   is sampled, and brings it up to date with the request's output (``Guide.of``): the decode
   node's guide consumes the prefill node's first token, so both advance the grammar over the
   same tokens. No matcher state ever travels.
3. Each step, ``Guide.fill`` writes the bitmask of the tokens the grammar allows next
   (``llguidance.LLMatcher``: EOS only where the grammar accepts, only EOS once it is
   complete); the sampler sets every other logit to -inf (``apply_masks_``).
4. Speculation: ``Guide.fill_draft`` keeps the draft's longest prefix the grammar accepts (a
   token it rejects ends the run) and writes one mask per position, as if the draft before it
   were accepted, so verification picks what plain decoding would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import llguidance
import llguidance.torch as llg_torch
import torch

from pd.core.request import Req

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def grammar_error(grammar: str) -> str:
    """Why llguidance cannot compile ``grammar`` ("" when it can): checked without a
    tokenizer, so the server needs none of llguidance's."""
    return llguidance.LLMatcher.validate_grammar(grammar, None)


def make_tokenizer(
    tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Sequence[int]
) -> llguidance.LLTokenizer:
    """llguidance's view of the HF tokenizer, over the model's ``vocab_size`` (ids past the
    tokenizer's are never allowed), with the engine's EOS ids as the grammar's end. Slow
    (seconds): built once per engine, when its first guided request is sampled."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(
        tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
    )


def allocate_masks(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask of ``num_rows`` rows: [num_rows, ceil(vocab_size / 32)] int32."""
    return llg_torch.allocate_token_bitmask(num_rows, vocab_size)


class Guide:
    """One request's grammar matcher, kept in step with its output (only new tokens are
    consumed at each step)."""

    def __init__(self, grammar: str, tokenizer: llguidance.LLTokenizer) -> None:
        self.matcher = llguidance.LLMatcher(tokenizer, grammar)
        self.num_consumed = 0  # leading output tokens the matcher has consumed
        self._check()

    @classmethod
    def of(cls, req: Req, tokenizer: Callable[[], llguidance.LLTokenizer]) -> Guide | None:
        """``req``'s guide, up to date with its output (kept on the request), or None when it
        has no grammar. ``tokenizer()``: the engine's llguidance tokenizer (built when first
        needed). ValueError if the grammar does not compile or the output broke it."""
        if not req.params.grammar:
            return None
        guide = req.guide
        if not isinstance(guide, Guide):
            guide = req.guide = cls(req.params.grammar, tokenizer())
        guide.sync(req.output_ids)
        return guide

    def sync(self, output_ids: Sequence[int]) -> None:
        """Consume the output tokens past those already consumed (an output only grows); once
        the grammar is complete, what follows (EOS under ``ignore_eos``) is not its business."""
        assert len(output_ids) >= self.num_consumed, (len(output_ids), self.num_consumed)
        new = list(output_ids[self.num_consumed :])
        if new and not self.matcher.is_stopped():
            self.matcher.consume_tokens(new)
            self._check()
        self.num_consumed = len(output_ids)

    def fill(self, masks: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``masks[row]``."""
        llg_torch.fill_next_token_bitmask(self.matcher, masks, row)

    def fill_draft(self, draft: Sequence[int], masks: torch.Tensor, row: int) -> list[int]:
        """The longest prefix of ``draft`` the grammar accepts, n tokens; ``masks[row + i]``
        for i in 0..n: the tokens allowed after ``draft[:i]``. The matcher ends as it began."""
        num_valid = self.matcher.validate_tokens(list(draft)) if draft else 0
        kept = list(draft[:num_valid])
        for i, token in enumerate(kept):
            self.fill(masks, row + i)
            ok = self.matcher.consume_token(token)
            assert ok, f"token {token} was validated but not consumed"
        self.fill(masks, row + len(kept))
        if kept:
            self.matcher.rollback(len(kept))
        return kept

    def _check(self) -> None:
        if self.matcher.is_error():
            raise ValueError(f"grammar: {self.matcher.get_error()}")


_BITS = torch.arange(32, dtype=torch.int32)


def apply_masks_(logits: torch.Tensor, masks: torch.Tensor) -> None:
    """Set to -inf, in place, every logit of logits [n, vocab] float32 that masks
    [n, ceil(vocab / 32)] int32 does not allow (bit j of word w: token 32 w + j). Eager (not
    llguidance's torch.compile'd kernel: no compile on a request's path)."""
    num_rows, vocab = logits.shape
    assert masks.shape == (num_rows, (vocab + 31) // 32), (masks.shape, logits.shape)
    masks = masks.to(logits.device)
    # allowed: [n, 32 * words] -> [n, vocab]
    allowed = ((masks[:, :, None] >> _BITS.to(logits.device)) & 1).reshape(num_rows, -1)
    logits.masked_fill_(allowed[:, :vocab] == 0, float("-inf"))
