"""Presence, frequency and repetition penalties, min_p and logprobs against plain reference
implementations of vLLM's definitions (written here, one Python loop per formula), through
``sample`` and speculative ``verify``, and their wire forms."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from pd.core.messages import DecodeReqMsg, PrefilledMsg, TokenLogprobsMsg, TokenMsg
from pd.core.request import Req
from pd.core.sampling_params import SamplingParams
from pd.executor.penalties import TokenCounts
from pd.executor.sampler import (
    make_generator,
    probs_from_logits,
    process_logits,
    sample,
    token_logprobs,
)
from pd.executor.spec import verify, verify_row

pytestmark = pytest.mark.timeout(30)

VOCAB = 40


def _logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 3


def _ref_penalised(
    logits: list[float], prompt: list[int], output: list[int], p: SamplingParams
) -> list[float]:
    """vLLM's penalties, one token at a time (vllm/model_executor/layers/utils.py)."""
    out = []
    for t, x in enumerate(logits):
        count = output.count(t)
        if (t in prompt or count > 0) and p.repetition_penalty != 1.0:
            x = x * (1.0 / p.repetition_penalty) if x > 0 else x * p.repetition_penalty
        x -= p.frequency_penalty * count
        x -= p.presence_penalty * (1.0 if count > 0 else 0.0)
        out.append(x)
    return out


def _ref_min_p(logits: list[float], p: SamplingParams) -> list[float]:
    """Probabilities after the temperature and min_p (no top_k/top_p), renormalised."""
    scaled = [x / p.temperature for x in logits]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    total = sum(weights)
    probs = [w / total for w in weights]
    floor = max(probs) * p.min_p
    kept = [q if q >= floor else 0.0 for q in probs]
    return [q / sum(kept) for q in kept]


def _req(prompt: list[int], output: list[int], params: SamplingParams) -> Req:
    req = Req("r", list(prompt), params)
    req.output_ids = list(output)
    return req


PROMPT = [1, 3, 3, 5, 7]
OUTPUT = [5, 9, 9, 9, 11, 3]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, repetition_penalty=1.7),
        SamplingParams(temperature=0.0, repetition_penalty=0.6),
        SamplingParams(temperature=0.0, frequency_penalty=0.75),
        SamplingParams(temperature=0.0, frequency_penalty=-1.5),
        SamplingParams(temperature=0.0, presence_penalty=1.25),
        SamplingParams(temperature=0.0, presence_penalty=-2.0),
        SamplingParams(
            temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4
        ),
    ],
    ids=["rep>1", "rep<1", "freq", "freq<0", "pres", "pres<0", "all"],
)
def test_each_penalty_matches_the_reference(params: SamplingParams) -> None:
    logits = _logits(1, seed=3)
    req = _req(PROMPT, OUTPUT, params)
    counts = TokenCounts.of(req, VOCAB)
    assert counts is not None
    want = _ref_penalised(logits[0].tolist(), PROMPT, OUTPUT, params)
    got = process_logits(logits, params, counts)[0].tolist()
    assert got == pytest.approx(want, abs=1e-6)
    # greedy picks the reference's argmax, and the caller's logits are left alone
    row = sample(logits, [params], [None], counts=[counts])[0]
    assert row.token == max(range(VOCAB), key=lambda t: want[t])
    assert torch.equal(logits, _logits(1, seed=3))


def test_penalties_change_a_repetitive_greedy_answer_as_defined() -> None:
    """A 'model' that always prefers token 5 by 0.5 over 6: plain greedy repeats 5; each
    penalty breaks the loop exactly where its formula says."""
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 5], logits[0, 6] = 2.0, 1.5

    def run(params: SamplingParams, n: int = 6) -> list[int]:
        req = _req([1, 2], [], params)
        for _ in range(n):
            counts = TokenCounts.of(req, VOCAB)
            req.output_ids.append(sample(logits, [params], [None], counts=[counts])[0].token)
        return req.output_ids

    assert run(SamplingParams(temperature=0.0)) == [5] * 6
    # presence 0.6: 5 -> 1.4 < 1.5 once seen; then 6 -> 0.9 < 1.4: back to 5 (both seen)
    assert run(SamplingParams(temperature=0.0, presence_penalty=0.6)) == [5, 6, 5, 5, 5, 5]
    # frequency 0.3: 5 falls by 0.3 per use: 2.0, 1.7 > 1.5, 1.4 < 1.5 -> 6 (1.2 < 1.4) -> 5 ...
    assert run(SamplingParams(temperature=0.0, frequency_penalty=0.3)) == [5, 5, 6, 5, 6, 5]
    # repetition 1.5: 5 -> 1.333 < 1.5 -> 6 -> 1.0 < 1.333 -> 5 for good (both seen)
    assert run(SamplingParams(temperature=0.0, repetition_penalty=1.5)) == [5, 6, 5, 5, 5, 5]
    # a prompt token is penalised by repetition before it is ever output
    req = _req([5], [], SamplingParams(temperature=0.0, repetition_penalty=1.5))
    counts = TokenCounts.of(req, VOCAB)
    assert sample(logits, [req.params], [None], counts=[counts])[0].token == 6


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_min_p_matches_the_reference(min_p: float, temperature: float) -> None:
    logits = _logits(1, seed=5)
    params = SamplingParams(temperature=temperature, min_p=min_p)
    want = _ref_min_p(logits[0].tolist(), params)
    got = probs_from_logits(logits, params)[0].tolist()
    assert got == pytest.approx(want, abs=1e-6)
    kept = [t for t, q in enumerate(want) if q > 0]
    gen = make_generator(params, 0)
    drawn = {sample(logits, [params], [gen])[0].token for _ in range(200)}
    assert drawn <= set(kept)
    if min_p == 1.0:  # only the top token is left
        assert drawn == {int(logits.argmax())}


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.8, seed=1, logprobs=3, min_p=0.05, top_k=10),
        SamplingParams(temperature=0.0, logprobs=0, repetition_penalty=1.4, frequency_penalty=0.2),
        SamplingParams(temperature=1.2, seed=2, logprobs=20, logit_bias=((4, 3.0),)),
    ],
    ids=["greedy", "sampled-cut", "greedy-penalties", "biased"],
)
def test_logprobs_are_the_log_softmax_of_the_processed_logits(params: SamplingParams) -> None:
    """The documented distribution: logits after logit_bias and the penalties, divided by
    the temperature (1 for greedy), before min_p/top_k/top_p cut them."""
    logits = _logits(1, seed=7)
    req = _req(PROMPT, OUTPUT, params)
    counts = TokenCounts.of(req, VOCAB)
    row = sample(logits, [params], [make_generator(params, 0)], counts=[counts])[0]
    ref = _ref_penalised(logits[0].tolist(), PROMPT, OUTPUT, params) if counts else None
    x = torch.tensor(ref) if ref is not None else logits[0].clone()
    for t, b in params.logit_bias:
        x[t] += b
    temperature = params.temperature if params.temperature > 0 else 1.0
    want = torch.log_softmax(x.double() / temperature, dim=-1)
    (lp,) = row.logprobs
    assert lp.token_id == row.token
    assert lp.logprob == pytest.approx(float(want[row.token]), abs=1e-5)
    assert len(lp.top_ids) == len(lp.top_logprobs) == params.logprobs
    assert lp.top_ids == want.topk(params.logprobs or 0).indices.tolist()
    assert lp.top_logprobs == pytest.approx(
        want.topk(params.logprobs or 0).values.tolist(), abs=1e-5
    )
    # no logprobs asked: none computed
    plain = SamplingParams(temperature=0.0)
    assert sample(logits, [plain], [None])[0].logprobs == ()


def test_banned_tokens_show_the_json_safe_floor() -> None:
    logits = _logits(1)
    params = SamplingParams(temperature=0.0, logprobs=2, min_tokens=1, max_tokens=4)
    top = int(logits.argmax())
    row = sample(logits, [params], [None], banned=[frozenset({top})])[0]
    assert row.token != top and top not in row.logprobs[0].top_ids
    only_zero = torch.full((1, VOCAB), float("-inf"))
    only_zero[0, 0] = 0.0
    (lp,) = token_logprobs(only_zero, [1], params)  # -inf: JSON has no infinity
    assert (lp.logprob, lp.top_ids[0], lp.top_logprobs) == (-9999.0, 0, [0.0, -9999.0])


@pytest.mark.parametrize("greedy", [True, False])
def test_verify_with_penalties_and_logprobs_equals_sampling_one_token_at_a_time(
    greedy: bool,
) -> None:
    """Each draft position is penalised as if the draft before it was accepted: verification
    appends exactly the tokens (and logprobs) plain decoding would."""
    params = SamplingParams(
        temperature=0.0 if greedy else 0.9,
        seed=11,
        logprobs=4,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.3,
    )
    rows = _logits(5, seed=9)
    for trial in range(20):
        g = torch.Generator().manual_seed(trial)
        draft = torch.randint(0, VOCAB, (4,), generator=g).tolist()
        if trial % 2:  # drafts that plain decoding would produce, so some are accepted
            req = _req(PROMPT, OUTPUT, params)
            gen = make_generator(params, 0)
            draft = []
            for i in range(4):
                counts = TokenCounts.of(req, VOCAB)
                token = sample(rows[i : i + 1], [params], [gen], counts=[counts])[0].token
                draft.append(token)
                req.output_ids.append(token)
        # plain decoding, one token a step, the same generator stream
        req = _req(PROMPT, OUTPUT, params)
        gen = make_generator(params, 0)
        want, want_lps = [], []
        for i in range(len(draft) + 1):
            counts = TokenCounts.of(req, VOCAB)
            row = sample(rows[i : i + 1], [params], [gen], counts=[counts])[0]
            want.append(row.token)
            want_lps.extend(row.logprobs)
            req.output_ids.append(row.token)
            if i < len(draft) and row.token != draft[i]:
                break
        req = _req(PROMPT, OUTPUT, params)
        counts = TokenCounts.of(req, VOCAB)
        got = verify_row(rows, draft, params, make_generator(params, 0), counts)
        assert [*got.accepted, got.token] == want, (trial, draft)
        assert list(got.logprobs) == want_lps
        assert verify(rows, draft, params, make_generator(params, 0), counts) == want
        assert counts.num_counted == len(OUTPUT), "verification must not count the draft"


def test_token_counts_follow_the_output() -> None:
    params = SamplingParams(frequency_penalty=1.0)
    req = _req([4, 4, 6], [], params)
    counts = TokenCounts.of(req, VOCAB)
    assert counts is not None and counts.counts == {}
    assert counts.prompt_ids.tolist() == [4, 6]
    req.output_ids += [7, 7, 8]
    assert TokenCounts.of(req, VOCAB) is counts  # kept on the request, counted incrementally
    assert (counts.counts, counts.num_counted) == ({7: 2, 8: 1}, 3)
    ids, seen, rows = counts.rows([9, 7])
    assert ids.tolist() == [4, 6, 7, 8, 9]
    assert rows.tolist() == [[0, 0, 2, 1, 0], [0, 0, 2, 1, 1], [0, 0, 3, 1, 1]]
    assert seen.tolist() == [[True, True, True, True, False]] + [[True] * 5] * 2
    assert TokenCounts.of(_req([1], [], SamplingParams()), VOCAB) is None


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2], got 2.5"),
        ("frequency_penalty", -2.01, "frequency_penalty must be in [-2, 2], got -2.01"),
        ("presence_penalty", float("nan"), "presence_penalty must be in [-2, 2]"),
        ("repetition_penalty", 0.0, "repetition_penalty must be > 0 and finite, got 0.0"),
        ("repetition_penalty", float("inf"), "repetition_penalty must be > 0 and finite"),
        ("min_p", 1.5, "min_p must be in [0, 1], got 1.5"),
        ("min_p", -0.1, "min_p must be in [0, 1], got -0.1"),
        ("logprobs", 21, "logprobs must be <= 20, got 21"),
        ("logprobs", -1, "logprobs must be >= 0, got -1"),
    ],
)
def test_sampling_params_bounds(field: str, value: object, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**{field: value})


def test_wire_forms_round_trip_and_decode_checks_the_new_fields() -> None:
    params = SamplingParams(
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1, min_p=0.1, logprobs=3
    )
    msg = DecodeReqMsg(
        request_id="r", prompt_ids=[1, 2], sampling=params, namespace="", prefill_node="p"
    )
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(DecodeReqMsg)
    assert dec.decode(enc.encode(msg)).sampling == params
    bad = msgspec.structs.replace(msg, sampling=SamplingParams())
    raw = msgspec.msgpack.decode(enc.encode(bad))
    raw["sampling"]["min_p"] = 7.0
    with pytest.raises(msgspec.ValidationError, match="min_p must be in"):
        dec.decode(enc.encode(raw))
    lp = TokenLogprobsMsg(5, -0.25, [5, 6], [-0.25, -1.5])
    first = PrefilledMsg(request_id="r", first_token=5, num_cached_tokens=0, first_logprobs=lp)
    assert msgspec.msgpack.Decoder(PrefilledMsg).decode(enc.encode(first)) == first
    tokens = TokenMsg(
        request_id="r",
        offset=0,
        token_ids=[5],
        finished=False,
        finish_reason=None,
        num_prompt_tokens=2,
        num_cached_tokens=0,
        logprobs=[lp],
    )
    assert msgspec.msgpack.Decoder(TokenMsg).decode(enc.encode(tokens)) == tokens
