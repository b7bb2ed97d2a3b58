"""Structured outputs across a prefill node and a decode node (in this process, the fake
transfer backend): the prefill node samples the first token under the grammar, the decode node
builds its own matcher from the grammar and the tokens it was handed, and the answer is the
colocated engine's, token for token, and follows its schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.model.tokenizer import load_tokenizer
from tests.engine.test_structured_engine import PERSON, POINT, _schema_grammar
from tests.node.harness import PROMPTS, assert_idle, run_until, send_request

pytestmark = pytest.mark.timeout(120)

SCHEMAS = [PERSON, POINT, PERSON]
PARAMS = [
    SamplingParams(max_tokens=96, temperature=0.0, grammar=_schema_grammar(SCHEMAS[0])),
    SamplingParams(max_tokens=96, temperature=0.9, seed=5, grammar=_schema_grammar(SCHEMAS[1])),
    SamplingParams(max_tokens=96, temperature=1.0, seed=8, grammar=_schema_grammar(SCHEMAS[2])),
]


def test_the_grammar_holds_across_the_prefill_to_decode_handoff(
    engine_cfg, server, make_pair
) -> None:
    want = [r.token_ids for r in Engine(engine_cfg).generate(PROMPTS, PARAMS)]
    tok = load_tokenizer(engine_cfg.model)
    p, d = make_pair()
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        send_request(server, p, d, f"g{i}", prompt, params)
    run_until(server, (d,), lambda: d.count_unfinished() == len(PARAMS))
    run_until(server, (p, d), lambda: all(f"g{i}" in server.finished for i in range(3)))
    for i, tokens in enumerate(want):
        rid = f"g{i}"
        assert server.finished[rid].error is None, server.finished[rid]
        assert server.tokens[rid] == tokens
        assert server.senders[rid][-1] == d.node_id  # the decode node wrote the rest
        jsonschema.validate(json.loads(tok.decode(tokens[:-1])), SCHEMAS[i])
    run_until(server, (p, d), lambda: d.count_unfinished() == 0, max_iters=100)
    assert_idle(p, d)
