"""The request models' ``sampling_kwargs``: derived from ``SamplingParams``' fields."""

from __future__ import annotations

import dataclasses

import pytest

from pd.core.sampling_params import SamplingParams
from pd.server.openai.protocol import (
    SET_BY_SERVER,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateSamplingParams,
)

FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "req",
    [
        CompletionRequest.model_validate({"prompt": "hi"}),
        ChatCompletionRequest.model_validate({"messages": MESSAGES}),
    ],
)
def test_openai_requests_carry_every_sampling_field_the_server_does_not_set(req) -> None:
    kwargs = req.sampling_kwargs()
    assert set(kwargs) == FIELDS - SET_BY_SERVER
    SamplingParams(max_tokens=1, **kwargs)  # each in SamplingParams' shape


def test_conversions_and_the_native_endpoints_fields() -> None:
    chat = ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "logprobs": True, "top_logprobs": 3, "stop": "x"}
    )
    kwargs = chat.sampling_kwargs()
    assert (kwargs["logprobs"], kwargs["stop"], kwargs["stop_token_ids"]) == (3, ("x",), ())
    completion = CompletionRequest.model_validate({"prompt": "a", "logprobs": 2})
    assert completion.sampling_kwargs()["logprobs"] == 2
    # /generate has no min_tokens, logprobs or grammar: SamplingParams' defaults
    native = GenerateSamplingParams.model_validate({"temperature": 0.5}).sampling_kwargs()
    assert set(native) == FIELDS - SET_BY_SERVER - {"min_tokens", "logprobs", "grammar"}
    assert native["temperature"] == 0.5
