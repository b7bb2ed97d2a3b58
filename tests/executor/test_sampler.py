"""Sampling: logit_bias (greedy and sampled), tiny temperatures, and SamplingParams' bounds."""

from __future__ import annotations

import msgspec
import pytest
import torch

from pd.core.messages import DecodeReqMsg
from pd.core.sampling_params import MAX_SEED, SamplingParams
from pd.executor.sampler import make_generator, sample

pytestmark = pytest.mark.timeout(30)

VOCAB = 50


def _logits(rows: int = 1) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(rows, VOCAB)


def test_logit_bias_moves_greedy_and_leaves_other_rows_alone() -> None:
    logits = _logits(3)
    top = logits.argmax(dim=-1).tolist()
    plain = SamplingParams(temperature=0.0)
    push = SamplingParams(temperature=0.0, logit_bias=((7, 100.0),))
    ban = SamplingParams(temperature=0.0, logit_bias=((top[2], -100.0),))
    rows = sample(logits, [plain, push, ban], [None, None, None])
    assert rows[0].token == top[0]
    assert rows[1].token == 7
    second = logits[2].topk(2).indices[1].item()
    assert rows[2].token == second
    assert torch.equal(logits, _logits(3)), "the caller's logits must not change"


def test_logit_bias_applies_to_sampling_too() -> None:
    logits = _logits(1)
    params = SamplingParams(temperature=1.0, seed=3, logit_bias=((11, 100.0), (12, -5.5)))
    tokens = [sample(logits, [params], [make_generator(params, 0)])[0].token for _ in range(20)]
    assert tokens == [11] * 20
    banned = SamplingParams(
        temperature=1.0, seed=3, logit_bias=tuple((t, -100.0) for t in range(VOCAB - 1))
    )
    row = sample(logits, [banned], [make_generator(banned, 0)])[0]
    assert (row.token, row.error) == (VOCAB - 1, None)


def test_logit_bias_outside_the_vocabulary_fails_that_row_only() -> None:
    params = [SamplingParams(temperature=0.0, logit_bias=((VOCAB, 1.0),)), SamplingParams()]
    rows = sample(_logits(2), params, [None, make_generator(params[1], 1)])
    assert rows[0].token == -1 and f"token {VOCAB} outside the vocabulary" in (rows[0].error or "")
    assert rows[1].error is None and 0 <= rows[1].token < VOCAB


@pytest.mark.parametrize("temperature", [0.0, 1e-9, 9.99e-6])
def test_tiny_temperature_is_greedy(temperature: float) -> None:
    params = SamplingParams(temperature=temperature)
    assert params.is_greedy and make_generator(params, 0) is None
    logits = _logits(1) * 1e30  # dividing these by the temperature would overflow
    assert sample(logits, [params], [None])[0].token == int(logits.argmax())


def test_sampling_params_travel_inside_messages_and_revalidate() -> None:
    params = SamplingParams(seed=MAX_SEED, top_k=2**31 - 1, logit_bias=((3, 5.0), (9, -100.0)))
    msg = DecodeReqMsg(
        request_id="r", prompt_ids=[1, 2], sampling=params, namespace="ns", prefill_node="p0"
    )
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=DecodeReqMsg)
    assert back.sampling == params and hash(back.sampling) == hash(params)
    for bad in ({"seed": 2**64 - 1}, {"top_k": 2**40}, {"logit_bias": [[9, 1.0], [3, 1.0]]}):
        raw = msgspec.msgpack.encode({"max_tokens": 4, **bad})
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(raw, type=SamplingParams)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seed": -1}, "seed must be >= 0, got -1"),
        ({"seed": 2**63}, f"seed must be <= {MAX_SEED}"),
        ({"top_k": 2**31}, "top_k must be <= 2147483647"),
        ({"max_tokens": 2**31}, "max_tokens must be <= 2147483647"),
        ({"temperature": float("inf")}, "temperature must be >= 0 and finite"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids must be >= 0"),
        ({"logit_bias": ((1, 100.5),)}, r"must be in \[-100, 100\], got 100.5"),
        ({"logit_bias": ((1, float("nan")),)}, "must be in"),
        ({"logit_bias": ((1, 1.0), (1, 2.0))}, "unique and in increasing order"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias token must be >= 0"),
    ],
)
def test_sampling_params_bounds(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_banned_tokens_are_never_sampled() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0], [0.0, 5.0, 4.0, 1.0]])
    greedy = SamplingParams(temperature=0.0)
    hot = SamplingParams(temperature=1.0, top_k=2, seed=1)
    rows = sample(
        logits, [greedy, hot], [None, make_generator(hot, 0)], [frozenset({1}), frozenset({1})]
    )
    assert rows[0].token == 2  # the next best
    assert rows[1].token == 2  # top-k 2 of what is left: 2 or 3, and 2 is far likelier
    assert sample(logits, [greedy], [None], [frozenset()])[0].token == 1


def test_min_tokens_holds_back_eos_and_stop_ids_until_reached(tiny_llama_dir) -> None:
    from pd.engine.engine import Engine
    from pd.executor.config import EngineConfig

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), max_total_tokens=512))
    prompt = [5, 17, 300, 42, 9]
    free = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    stop = free.token_ids[2]  # a token the free run samples third: make it a stop id
    stopped = engine.generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop,))
    )[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) <= 3
    held = engine.generate(
        [prompt],
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop,), min_tokens=8),
    )[0]
    assert stop not in held.token_ids[:8] and len(held.token_ids) >= 8
    with pytest.raises(ValueError, match="min_tokens must be <= 4"):
        SamplingParams(max_tokens=4, min_tokens=5)
