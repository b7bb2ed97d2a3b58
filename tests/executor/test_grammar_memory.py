"""What compiled grammars hold in memory is bounded by what was sent: the compiler's cache is
bounded in grammar characters, not only in count (``pd.executor.grammar.GrammarCompiler``).
Real llguidance builds over SmolLM2's tokenizer; the process's RSS is read from /proc."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import llguidance
import pytest

from pd.core.request import Req
from pd.core.sampling_params import SamplingParams
from pd.executor.grammar import GrammarCompiler, Guide, make_tokenizer
from pd.model.tokenizer import eos_token_ids, load_tokenizer

pytestmark = pytest.mark.timeout(420)

MAX_CHARS = 262_144  # EngineConfig's --max-grammar-chars
NUM_SCHEMAS = 20
MAX_GROWTH_MIB = 32  # once the cache holds its budget's worth


def _grammar(seed: int, num_chars: int = 128_000) -> str:
    """A JSON schema's grammar of ~``num_chars`` characters, its own for each ``seed``: many
    objects whose strings each have a pattern of their own (the lane's big schema)."""
    props, size = {}, 0
    while size < num_chars:
        i = len(props)
        field = {
            "type": "object",
            "properties": {"n": {"type": "integer"},
                           "s": {"type": "string", "pattern": f"^[a-z]{{1,{i % 9 + 1}}}q{seed}x{i}$"}},
            "required": ["n", "s"],
        }  # fmt: skip
        props[f"f{i}"] = field
        size += len(json.dumps(field)) + 8
    schema = {"type": "object", "properties": props}
    return llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False}
    )


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_distinct_large_grammars_hold_a_bounded_memory(smollm2_dir: Path) -> None:
    """20 distinct schemas of ~128k characters, one after another: once the cache holds what
    its character budget allows (4 of them), RSS grows by less than ``MAX_GROWTH_MIB`` over the
    16 others. With a cache of 16 by count, each kept its ~8 MiB matcher: ~+100 MiB."""
    hf = load_tokenizer(smollm2_dir)
    tokenizer = make_tokenizer(hf, len(hf), eos_token_ids(smollm2_dir))
    compiler = GrammarCompiler(lambda: tokenizer, MAX_CHARS, timeout_s=120.0)
    try:
        grammars = [_grammar(seed) for seed in range(NUM_SCHEMAS)]
        budget_full = 2 * MAX_CHARS // max(len(g) for g in grammars)  # compiles the cache keeps
        rss = []
        for i, grammar in enumerate(grammars):
            req = Req(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4, grammar=grammar))
            while not compiler.prepare(req):
                compiler.wait(0.1)
            assert isinstance(req.guide, Guide), req.guide
            del req
            gc.collect()
            rss.append(_rss_mib())
        growth = rss[-1] - rss[budget_full - 1]
        trace = ", ".join(f"{r:.0f}" for r in rss)
        assert growth < MAX_GROWTH_MIB, f"+{growth:.0f} MiB after {budget_full} compiles: {trace}"
        assert compiler.num_cached_chars <= compiler.max_cached_chars == 2 * MAX_CHARS
    finally:
        compiler.close()
