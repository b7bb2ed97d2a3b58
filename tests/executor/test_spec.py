"""N-gram speculative decoding: what ``propose`` drafts, and that ``verify`` appends what plain
decoding would (greedy exactly; sampled in distribution, checked by a chi-square test)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from pd.core.sampling_params import SamplingParams
from pd.executor.sampler import make_generator, probs_from_logits, sample
from pd.executor.spec import propose, verify

pytestmark = pytest.mark.timeout(60)

VOCAB = 6
GREEDY = SamplingParams(temperature=0.0)
# chi-square critical values at 0.999 by degrees of freedom: a correct verify fails a given
# seed with probability 0.001, and the seeds are fixed, so the test is deterministic
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def _propose_reference(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The rule as written in ``propose``'s docstring, the slow obvious way."""
    for n in range(max_ngram, min_ngram - 1, -1):
        key = tokens[len(tokens) - n :]
        if n >= len(tokens):
            continue
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == key:
                return tokens[start + n : start + n + k]
    return []


def _make_logits(rows: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=gen) * 1.5


def _make_peaked_logits(best: Sequence[int]) -> torch.Tensor:
    """One row per token of ``best``, with that token the argmax."""
    logits = _make_logits(len(best))
    logits[torch.arange(len(best)), list(best)] = 10.0
    return logits


def test_propose_prefers_the_longest_ngram() -> None:
    tokens = [1, 2, 3, 10, 11, 9, 2, 3, 20, 21, 1, 2, 3]
    # [2, 3] last occurred before 20, but [1, 2, 3] (longer) occurred before 10
    assert propose(tokens, 2) == [10, 11]
    assert propose(tokens, 2, max_ngram=2) == [20, 21]


def test_propose_takes_the_most_recent_occurrence() -> None:
    assert propose([1, 2, 5, 1, 2, 6, 1, 2], 2) == [6, 1]


def test_propose_returns_at_most_k_and_stops_at_the_end_of_the_sequence() -> None:
    tokens = [7, 8, 9, 7, 8]
    assert propose(tokens, 2) == [9, 7]
    assert propose(tokens, 5) == [9, 7, 8]
    assert propose(tokens, 0) == []


def test_propose_returns_nothing_without_a_match_or_with_too_few_tokens() -> None:
    assert propose([4, 5, 6, 7, 4], 3) == []  # only a 1-gram matches, below min_ngram
    assert propose([4, 5, 6, 7, 4], 3, min_ngram=1) == [5, 6, 7]
    assert propose([], 3) == []
    assert propose([5], 3) == []
    assert propose([5, 5], 3) == []  # the 2-gram is the suffix itself


def test_propose_never_matches_the_suffix_itself_but_may_overlap_it() -> None:
    assert propose([1, 2, 3, 4], 3) == []
    assert propose([3, 3, 3], 3) == [3]  # [3, 3] at 0, followed by the last 3
    assert propose((3, 3, 3, 3, 3), 9, max_ngram=2) == [3]  # the most recent, any Sequence


def test_propose_agrees_with_the_reference_rule_on_random_sequences() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(12))]
        k, max_ngram = rng.randrange(1, 5), rng.randrange(1, 6)
        min_ngram = rng.randrange(1, max_ngram + 1)
        expected = _propose_reference(tokens, k, max_ngram, min_ngram)
        assert propose(tokens, k, max_ngram=max_ngram, min_ngram=min_ngram) == expected, tokens


def test_propose_rejects_bad_ngram_bounds() -> None:
    with pytest.raises(ValueError, match="got 3 and 2"):
        propose([1, 2, 3], 2, max_ngram=2, min_ngram=3)


def test_greedy_verify_accepts_a_right_draft_and_adds_the_bonus_token() -> None:
    logits = _make_peaked_logits([4, 1, 3, 5])
    assert verify(logits, [4, 1, 3], GREEDY, None) == [4, 1, 3, 5]


def test_greedy_verify_stops_at_the_first_mismatch_with_the_argmax() -> None:
    logits = _make_peaked_logits([4, 1, 3, 5])
    assert verify(logits, [0, 1, 3], GREEDY, None) == [4]
    assert verify(logits, [4, 1, 2], GREEDY, None) == [4, 1, 3]


@pytest.mark.parametrize("bias", [(), ((2, 100.0),)])
def test_greedy_verify_equals_greedy_sampling_token_by_token(bias: tuple) -> None:
    params = SamplingParams(temperature=0.0, logit_bias=bias)
    for seed in range(20):
        logits = _make_logits(5, seed)
        draft = torch.randint(0, VOCAB, (4,), generator=torch.Generator().manual_seed(seed))
        draft[:2] = logits[:2].argmax(dim=-1)  # some drafts right, some not
        expected = []
        for i in range(5):
            expected.append(sample(logits[i : i + 1], [params], [None])[0].token)
            if i == 4 or expected[-1] != draft[i]:
                break
        assert verify(logits, draft.tolist(), params, None) == expected


def test_verify_without_a_draft_samples_row_zero_as_sample_does() -> None:
    logits = _make_logits(1)
    assert verify(logits, [], GREEDY, None) == [int(logits.argmax())]
    for seed in range(10):
        params = SamplingParams(temperature=0.8, top_p=0.9, seed=seed)
        expected = sample(logits, [params], [make_generator(params, 0)])[0].token
        assert verify(logits, [], params, make_generator(params, 0)) == [expected]


def test_sampled_verify_is_reproducible_with_a_seeded_generator() -> None:
    logits = _make_logits(4)
    params = SamplingParams(temperature=0.8, seed=7)
    runs = []
    for _ in range(2):
        gen = make_generator(params, 0)
        runs.append([verify(logits, [1, 2, 3], params, gen) for _ in range(50)])
    assert runs[0] == runs[1]


def test_target_probabilities_cut_top_k_and_top_p_and_sum_to_one() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    cases = [
        (SamplingParams(), [0.5, 0.3, 0.15, 0.05]),
        (SamplingParams(top_k=3), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        (SamplingParams(top_p=0.7), [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),  # 0.8 reaches 0.7
        (SamplingParams(top_p=0.8), [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
        (SamplingParams(top_p=0.81), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
    ]
    for params, expected in cases:
        probs = probs_from_logits(logits, params)
        assert torch.allclose(probs, torch.tensor(expected), atol=1e-6), (params, probs)


def _assert_follows(tokens: list[int], probs: torch.Tensor) -> None:
    """A chi-square test that ``tokens`` were drawn from ``probs``; tokens of probability 0
    must never appear."""
    counts = Counter(tokens)
    allowed = [t for t in range(VOCAB) if probs[t] > 0]
    assert set(counts) <= set(allowed), f"drew {counts} with probabilities {probs.tolist()}"
    chi2 = sum(
        (counts[t] - len(tokens) * probs[t].item()) ** 2 / (len(tokens) * probs[t].item())
        for t in allowed
    )
    assert chi2 < CHI2_999[len(allowed) - 1], (
        f"chi2 {chi2:.1f} over {len(tokens)} draws: {sorted(counts.items())} "
        f"vs {[round(p, 3) for p in probs.tolist()]}"
    )


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.8, top_k=4),
        SamplingParams(temperature=0.8, top_p=0.8),
    ],
    ids=["temperature", "top_k", "top_p"],
)
def test_sampled_verify_appends_tokens_distributed_as_the_target(params: SamplingParams) -> None:
    """Position 0 follows p_0; position 1, given draft[0] was accepted, follows p_1; the bonus
    after a fully accepted draft follows p_2. A verify that accepted every draft, or resampled
    a rejection from p_i instead of the residual, fails by chi2 in the thousands."""
    num_runs = 20_000
    logits = _make_logits(3, seed=1)
    probs = probs_from_logits(logits, params)  # [3, VOCAB]
    # a draft of moderate probability at each position, so both branches are taken often
    draft = [int((probs[i] - 0.35).abs().argmin()) for i in range(2)]
    assert all(0.15 < probs[i, t] < 0.6 for i, t in enumerate(draft)), probs
    gen = torch.Generator().manual_seed(123)
    runs = [verify(logits, draft, params, gen) for _ in range(num_runs)]
    _assert_follows([run[0] for run in runs], probs[0])
    _assert_follows([run[1] for run in runs if run[0] == draft[0]], probs[1])
    _assert_follows([run[2] for run in runs if run[:2] == draft], probs[2])


def test_sampled_verify_always_rejects_a_draft_the_target_cannot_sample() -> None:
    params = SamplingParams(temperature=0.8, top_k=2)
    logits = _make_logits(2, seed=2)
    probs = probs_from_logits(logits, params)
    outside = int(probs[0].argmin())
    gen = torch.Generator().manual_seed(5)
    runs = [verify(logits, [outside], params, gen) for _ in range(2000)]
    assert all(len(run) == 1 for run in runs)
    _assert_follows([run[0] for run in runs], probs[0])
