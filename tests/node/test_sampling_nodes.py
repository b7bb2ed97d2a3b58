"""Penalties and logprobs across a prefill node and a decode node (in this process, the fake
transfer backend): the first token's logprobs come from the prefill node with it, the rest
from the decode node, and tokens and logprobs equal the colocated engine's."""

from __future__ import annotations

import pytest

from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from tests.node.harness import PROMPTS, assert_idle, run_until, send_request

pytestmark = pytest.mark.timeout(90)

PARAMS = [
    SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5, repetition_penalty=1.5
    ),
    SamplingParams(
        max_tokens=8,
        temperature=0.9,
        seed=7,
        ignore_eos=True,
        logprobs=2,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        min_p=0.01,
    ),
    SamplingParams(max_tokens=1, temperature=0.0, logprobs=3, presence_penalty=1.0),
]


def _colocated(engine_cfg: EngineConfig) -> list[tuple[list[int], list]]:
    engine = Engine(engine_cfg)
    out = []
    for prompt, params in zip(PROMPTS, PARAMS):
        rid = engine.add_request(prompt, params)
        tokens, lps = [], []
        while engine.has_unfinished:
            for o in engine.step():
                assert o.request_id == rid and o.error is None
                tokens += o.new_token_ids
                lps += o.logprobs
        out.append((tokens, lps))
    return out


def test_disaggregated_penalties_and_logprobs_equal_the_colocated_engine(
    engine_cfg, server, make_pair
) -> None:
    want = _colocated(engine_cfg)
    p, d = make_pair()
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        send_request(server, p, d, f"s{i}", prompt, params)
    # the decode node knows the requests before the prefill node runs: otherwise the prefill
    # node's "forget s2" (it ends at its first token) may overtake the server's message
    run_until(server, (d,), lambda: d.count_unfinished() == len(PARAMS))
    run_until(server, (p, d), lambda: all(f"s{i}" in server.finished for i in range(3)))
    for i, (tokens, lps) in enumerate(want):
        rid = f"s{i}"
        assert server.finished[rid].error is None
        assert server.tokens[rid] == tokens
        assert len(server.logprobs[rid]) == len(tokens) == PARAMS[i].max_tokens
        assert server.logprobs[rid] == lps  # the deterministic path: the same bits
    # the first token and its logprobs come from the decode node (which got them in
    # PrefilledMsg), but for the one-token request, answered by the prefill node
    assert server.senders["s0"][0] == d.node_id
    assert server.senders["s2"] == [p.node_id]
    run_until(server, (p, d), lambda: d.count_unfinished() == 0, max_iters=100)
    assert_idle(p, d)


def test_a_seeded_sampled_request_draws_as_in_one_engine(engine_cfg, server, make_pair) -> None:
    """The prefill node draws the first token; the decode node's generator, seeded alike,
    skips that draw, so the rest are the colocated engine's tokens, not a restarted stream."""
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    (want,) = Engine(engine_cfg).generate([PROMPTS[1]], params)
    p, d = make_pair()
    send_request(server, p, d, "seeded", PROMPTS[1], params)
    run_until(server, (p, d), lambda: "seeded" in server.finished)
    assert server.tokens["seeded"] == want.token_ids
    run_until(server, (p, d), lambda: d.count_unfinished() == 0, max_iters=100)
    assert_idle(p, d)
