"""Whether a waiting request waits for a prompt being prefilled (plain Python).

A request that shares at least ``MIN_DEFERRED_SHARED_TOKENS`` tokens the prefix cache does not
hold yet with a prompt still being prefilled (``pending_prompts``) waits, and others
go ahead of it, until that prompt is cached: it then computes only its own part instead of the
shared one a second time.
"""

from __future__ import annotations

from collections.abc import Sequence

from pd.cache.base import BasePrefixCache
from pd.core.request import Req

# SGLang's in-batch prefix check uses 32 too.
MIN_DEFERRED_SHARED_TOKENS = 32


def pending_prompts(running: Sequence[Req]) -> list[tuple[str, list[int]]]:
    """(namespace, tokens) of the ``running`` prompts being computed (not paused) that the
    cache will hold soon."""
    return [
        (r.namespace, r.all_ids[: r.fill_len])
        for r in running
        if r.is_prefilling and not r.is_paused
    ]


def shares_pending_prompt(
    req: Req, pending: Sequence[tuple[str, list[int]]], cache: BasePrefixCache
) -> bool:
    """``req`` shares ``MIN_DEFERRED_SHARED_TOKENS`` uncached tokens with one of the
    ``pending`` (namespace, tokens) prompts of its namespace."""
    tokens = req.all_ids[: req.fill_len]
    shared = max(
        (common_prefix_len(tokens, prompt) for ns, prompt in pending if ns == req.namespace),
        default=0,
    )
    if shared < MIN_DEFERRED_SHARED_TOKENS:
        return False
    cached = cache.match_prompt(tokens, req.namespace).num_tokens
    return shared - cached >= MIN_DEFERRED_SHARED_TOKENS


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix (compared in blocks, then token by token)."""
    n, block, i = min(len(a), len(b)), 64, 0
    while i + block <= n and a[i : i + block] == b[i : i + block]:
        i += block
    while i < n and a[i] == b[i]:
        i += 1
    return i
