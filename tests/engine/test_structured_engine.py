"""Structured outputs in the colocated engine on a tiny random checkpoint (SmolLM2's
tokenizer): whatever the random model prefers, every answer follows its grammar and ends with
EOS only once the grammar accepts; speculative decoding gives the same tokens as plain
decoding, a draft token the grammar rejects ending the accepted run."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import pytest
import torch

from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from pd.model.tokenizer import load_tokenizer
from tests.engine.test_spec_engine import _oracle

pytestmark = pytest.mark.timeout(180)

# bounded, so a random model's answer completes within max_tokens
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
POINT = {
    "type": "object",
    "properties": {"x": {"type": "number"}, "y": {"type": "integer"}},
    "required": ["x", "y"],
    "additionalProperties": False,
}
REGEX = r"(yes|no)-[0-9]{2,4}"


def _schema_grammar(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False}
    )


def _prompt(seed: int, vocab: int, n: int = 12) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n,), generator=g).tolist()


def _engine(model_dir, **kw) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), max_total_tokens=4096, **kw))


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_every_answer_follows_its_grammar_and_stops_with_eos(tiny_llama_dir, temperature):
    engine = _engine(tiny_llama_dir)
    tok = load_tokenizer(tiny_llama_dir)
    eos = engine.scheduler.eos_token_ids
    vocab = engine.runner.model_config.vocab_size
    cases = [("json", PERSON), ("json", POINT), ("regex", REGEX)] * 2
    prompts = [_prompt(seed, vocab) for seed in range(len(cases))]
    params = [
        SamplingParams(
            max_tokens=96,
            temperature=temperature,
            seed=seed,
            grammar=_schema_grammar(spec)
            if kind == "json"
            else llguidance.LLMatcher.grammar_from_regex(spec),
        )
        for seed, (kind, spec) in enumerate(cases)
    ]
    results = engine.generate(prompts, params)  # one batch: the masks of 6 rows at once
    for (kind, spec), res in zip(cases, results):
        assert res.finish_reason == "stop" and res.token_ids[-1] in eos, res
        text = tok.decode(res.token_ids[:-1])
        if kind == "json":
            jsonschema.validate(json.loads(text), spec)
        else:
            assert re.fullmatch(spec, text), text
    # without the grammar the random model writes no JSON at all
    (free,) = engine.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0))
    with pytest.raises(ValueError):
        json.loads(tok.decode(free.token_ids))
    engine.check_integrity()


@pytest.mark.parametrize(("temperature", "wrong_at"), [(0.0, None), (0.0, 1), (0.9, 2)])
def test_speculation_under_a_grammar_gives_the_same_tokens(
    tiny_llama_dir, monkeypatch, temperature, wrong_at
) -> None:
    """The oracle drafts the plain answer (wrong at ``wrong_at``: a token the grammar mostly
    rejects, so the draft is cut there) and then what follows the answer's EOS."""
    plain = _engine(tiny_llama_dir)
    spec = _engine(tiny_llama_dir, speculative_tokens=4)
    vocab = plain.runner.model_config.vocab_size
    prompts = [_prompt(seed, vocab) for seed in range(3)]
    params = SamplingParams(
        max_tokens=64, temperature=temperature, seed=7, grammar=_schema_grammar(POINT)
    )
    want = [r.token_ids for r in plain.generate(prompts, params)]
    _oracle(monkeypatch, prompts, [w + [5, 6, 7] for w in want], vocab, wrong_at)
    got = [r.token_ids for r in spec.generate(prompts, params)]
    assert got == want
    stats = spec.scheduler.stats()
    assert stats.num_accepted_tokens > 0, "no draft was accepted: the test checks nothing"
    spec.check_integrity()


def test_a_grammar_that_does_not_compile_fails_its_request_alone(tiny_llama_dir) -> None:
    """A node gets a grammar the server did not check (the server refuses it with a 400,
    tests/server/test_structured_api.py): that request fails saying why, its batch goes on."""
    engine = _engine(tiny_llama_dir)
    vocab = engine.runner.model_config.vocab_size
    bad = SamplingParams(max_tokens=4, grammar='{"grammars": [{"json_schema": {"type": "x"}}]}')
    good = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    rid_bad = engine.add_request(_prompt(0, vocab), bad)
    rid_good = engine.add_request(_prompt(1, vocab), good)
    errors, tokens = {}, {}
    while engine.has_unfinished:
        for out in engine.step():
            errors[out.request_id] = out.error
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert "grammar" in (errors[rid_bad] or "") and "x" in errors[rid_bad]
    assert errors[rid_good] is None and len(tokens[rid_good]) == 4
    engine.check_integrity()
