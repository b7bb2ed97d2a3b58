"""The engine's per-token logprobs (``TokenLogprobsMsg``) in OpenAI's two response shapes.

A token's text is ``tokenizer.decode([id])`` (as vLLM's): a token that holds part of a UTF-8
character shows as U+FFFD, and its ``bytes`` are that text's UTF-8 bytes. Completions'
``text_offset`` counts these texts' lengths from where the chunk's text starts (vLLM's rule),
so it can differ from offsets into the detokenized text around such tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from pd.core.messages import TokenLogprobsMsg
from pd.server.openai.responses import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)


@functools.lru_cache(maxsize=1 << 18)  # one entry per (tokenizer, id): a vocabulary or two
def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _top(tokenizer: Any, token_id: int, logprob: float) -> TopLogprob:
    text = token_text(tokenizer, token_id)
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))


def chat_logprobs(tokenizer: Any, logprobs: Sequence[TokenLogprobsMsg]) -> ChatLogprobs:
    """``choices[].logprobs`` of a chat answer or chunk: each token with its top alternatives."""
    content = []
    for lp in logprobs:
        top = [_top(tokenizer, t, v) for t, v in zip(lp.top_ids, lp.top_logprobs)]
        token = _top(tokenizer, lp.token_id, lp.logprob)
        content.append(ChatTokenLogprob(**token.model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(
    tokenizer: Any, logprobs: Sequence[TokenLogprobsMsg], text_offset: int
) -> CompletionLogprobs:
    """``choices[].logprobs`` of a completion or chunk whose text starts at ``text_offset``.
    Each ``top_logprobs`` entry holds the alternatives and the sampled token (OpenAI's: up to
    logprobs + 1 entries)."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for lp in logprobs:
        text = token_text(tokenizer, lp.token_id)
        top = {token_text(tokenizer, t): v for t, v in zip(lp.top_ids, lp.top_logprobs)}
        top.setdefault(text, lp.logprob)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out
