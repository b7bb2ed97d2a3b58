"""Penalties and logprobs in the colocated engine on a tiny random fp32 checkpoint: logprobs
equal a recomputation from HF transformers' logits (cold and on a prefix-cache hit), and
speculative decoding gives the same tokens and logprobs as plain decoding."""

from __future__ import annotations

import pytest
import torch

from pd.core.messages import TokenLogprobsMsg
from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from tests.engine.test_spec_engine import _oracle
from tests.hf_reference import load_hf_model

pytestmark = pytest.mark.timeout(120)

PENALTIES = {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.2}


def _prompt(seed: int, vocab: int, n: int = 24) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(100, vocab, (n // 3,), generator=g).tolist()
    return base * 3  # repetitive, so repetition_penalty has prompt tokens to find


def _run(
    engine: Engine, prompt: list[int], params: SamplingParams
) -> tuple[list[int], list[TokenLogprobsMsg], int]:
    """(tokens, their logprobs, cached prompt tokens) of one request, stepped to its end."""
    rid = engine.add_request(prompt, params)
    tokens: list[int] = []
    logprobs: list[TokenLogprobsMsg] = []
    cached = -1
    while engine.has_unfinished:
        for out in engine.step():
            assert out.request_id == rid and out.error is None, out
            tokens += out.new_token_ids
            logprobs += out.logprobs
            cached = out.num_cached_tokens
    return tokens, logprobs, cached


def _reference(
    model_dir, prompt: list[int], tokens: list[int], params: SamplingParams
) -> torch.Tensor:
    """[len(tokens), vocab] log-probabilities recomputed from HF's fp32 logits with vLLM's
    penalties written out: what each token was drawn from (temperature 1 when greedy)."""
    model = load_hf_model(str(model_dir))
    ids = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 :].double()  # [len(tokens), vocab]
    out = []
    for i, row in enumerate(logits):
        output = tokens[:i]
        counts = torch.zeros_like(row)
        for t in output:
            counts[t] += 1
        seen = counts > 0
        seen[prompt] = True
        r = params.repetition_penalty
        row = torch.where(seen, torch.where(row > 0, row / r, row * r), row)
        row = row - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
        temperature = params.temperature if params.temperature > 0 else 1.0
        out.append(torch.log_softmax(row / temperature, dim=-1))
    return torch.stack(out)


def _assert_close(lps: list[TokenLogprobsMsg], tokens: list[int], ref: torch.Tensor, k: int):
    assert [lp.token_id for lp in lps] == tokens
    for i, lp in enumerate(lps):
        assert abs(lp.logprob - float(ref[i, tokens[i]])) < 1e-4, (i, lp.logprob)
        top = ref[i].topk(k)
        assert len(lp.top_ids) == k
        got = torch.tensor(lp.top_logprobs, dtype=torch.float64)
        assert torch.allclose(got, top.values, atol=1e-4), (i, got, top.values)
        # the ids agree but where two alternatives are closer than the tolerance
        for j, t in enumerate(lp.top_ids):
            assert t == int(top.indices[j]) or abs(float(ref[i, t]) - float(top.values[j])) < 1e-4


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=5),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3, **PENALTIES),
        SamplingParams(
            max_tokens=10, temperature=0.8, seed=5, ignore_eos=True, logprobs=20, min_p=0.02
        ),
    ],
    ids=["greedy", "greedy-penalties", "sampled"],
)
def test_logprobs_match_hf_logits_cold_and_on_a_cache_hit(tiny_llama_dir, params) -> None:
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), max_total_tokens=2048))
    vocab = engine.runner.model_config.vocab_size
    prompt = _prompt(1, vocab)
    tokens, lps, cached = _run(engine, prompt, params)
    assert cached == 0 and len(tokens) == 10
    ref = _reference(tiny_llama_dir, prompt, tokens, params)
    _assert_close(lps, tokens, ref, params.logprobs or 0)
    if params.is_greedy:  # each token is the argmax of the penalised distribution
        assert tokens == ref.argmax(dim=-1).tolist()
    again, lps_again, cached = _run(engine, prompt, params)  # the prompt is cached now
    assert cached > 0 and again == tokens
    _assert_close(lps_again, tokens, ref, params.logprobs or 0)
    assert lps_again == lps  # the deterministic path: the same bits whatever the cache holds
    engine.check_integrity()


def _ref_greedy(model_dir, prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    """Greedy decoding on HF's fp32 logits with logit_bias and vLLM's penalties written out."""
    model = load_hf_model(str(model_dir))
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            row = model(torch.tensor([prompt + out])).logits[0, -1].double()
        for t, b in params.logit_bias:
            row[t] += b
        counts = torch.zeros_like(row)
        for t in out:
            counts[t] += 1
        seen = counts > 0
        seen[prompt] = True
        r = params.repetition_penalty
        row = torch.where(seen, torch.where(row > 0, row / r, row * r), row)
        row = row - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
        out.append(int(row.argmax()))
    return out


@pytest.mark.parametrize(
    "penalty",
    [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 4.0}],
    ids=["frequency", "presence", "repetition"],
)
def test_penalties_change_a_repetitive_greedy_answer_as_defined(tiny_llama_dir, penalty) -> None:
    """logit_bias makes the random model repeat one token; each penalty breaks the loop, and
    the answer is greedy decoding of HF's logits with that penalty's formula applied."""
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), max_total_tokens=2048))
    vocab = engine.runner.model_config.vocab_size
    prompt = _prompt(2, vocab)
    loop = 777  # not in the prompt: the repetition penalty meets it first in the output
    assert loop not in prompt
    # the smallest bias (+0.5) that makes greedy repeat ``loop`` 12 times
    with torch.no_grad():
        ids = torch.tensor([prompt + [loop] * 11])
        logits = load_hf_model(str(tiny_llama_dir))(ids).logits[0, len(prompt) - 1 :]
    bias = float((logits.max(dim=-1).values - logits[:, loop]).max()) + 0.5
    kw = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "logit_bias": ((loop, bias),)}
    (plain,) = engine.generate([prompt], SamplingParams(**kw))
    assert plain.token_ids == [loop] * 12, "the bias must make a repetitive answer"
    params = SamplingParams(**kw, **penalty)
    (got,) = engine.generate([prompt], params)
    assert got.token_ids != plain.token_ids
    assert got.token_ids == _ref_greedy(tiny_llama_dir, prompt, params, 12)


@pytest.mark.parametrize(("temperature", "wrong_at"), [(0.0, 1), (0.9, None)])
def test_speculation_with_penalties_and_logprobs_gives_the_same_tokens(
    tiny_llama_dir, monkeypatch, wrong_at, temperature
) -> None:
    plain = Engine(EngineConfig(model=str(tiny_llama_dir), max_total_tokens=4096))
    spec = Engine(
        EngineConfig(model=str(tiny_llama_dir), max_total_tokens=4096, speculative_tokens=4)
    )
    vocab = plain.runner.model_config.vocab_size
    prompts = [_prompt(seed, vocab) for seed in range(3)]
    params = SamplingParams(
        max_tokens=24, temperature=temperature, seed=3, ignore_eos=True, logprobs=4, **PENALTIES
    )
    want = [_run(plain, p, params)[:2] for p in prompts]
    _oracle(monkeypatch, prompts, [w[0] for w in want], vocab, wrong_at)
    got = [_run(spec, p, params)[:2] for p in prompts]
    stats = spec.scheduler.stats()
    assert stats.num_accepted_tokens > 0, "no draft was accepted: the test checks nothing"
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want):
        assert tokens == want_tokens
        assert [lp.top_ids for lp in lps] == [lp.top_ids for lp in want_lps]
        flat = [v for lp in lps for v in (lp.logprob, *lp.top_logprobs)]
        want_flat = [v for lp in want_lps for v in (lp.logprob, *lp.top_logprobs)]
        assert flat == pytest.approx(want_flat, abs=1e-5)
    spec.check_integrity()
