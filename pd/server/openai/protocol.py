"""Pydantic models of the HTTP API's requests (OpenAI completions/chat, SGLang-like /generate).

Requests are strict (no "16" for 16, no NaN) so a wrong type is a 400, not a silent coercion.
Every field is one of three kinds, and anything else is refused with a 400 that names it:

- implemented (``temperature``, ``stop``, ``logit_bias``, the penalties, ``min_p``,
  ``logprobs``, ``cache_salt``, ``n`` up to ``MAX_N``, ``priority``, structured outputs
  (``response_format``, vLLM's ``guided_*`` and ``structured_outputs``:
  ``pd.server.openai.structured``), ...);
- accepted only at its neutral value (``neutral_values``: ``best_of=n``,
  ``echo=false``, ...), because common clients send it at that value;
- harmless and ignored (``user``, ``metadata``, ``stream_options`` without a stream's usage ...).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from pd.core.sampling_params import (
    MAX_INT32,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_SEED,
    SamplingParams,
)
from pd.server.http.errors import APIError
from pd.server.openai.structured import grammar_of

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's legacy completions: logprobs in 0..5
MAX_N = 16  # choices one request may ask for
# SamplingParams' fields the server sets itself, not a request's ``sampling_kwargs``: the budget
# and the bias once checked against the context and the vocabulary, the priority from the key's
SET_BY_SERVER = frozenset({"max_tokens", "logit_bias", "priority"})
_ABSENT = object()

__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "GenerateRequest",
    "GenerateSamplingParams",
]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    # field -> the values at which it changes nothing; any other value is refused with a 400
    neutral_values: ClassVar[dict[str, tuple[Any, ...]]] = {}

    def check_supported(self) -> None:
        for name, allowed in self.neutral_values.items():
            value = getattr(self, name)
            if value not in allowed:
                only = " or ".join(f"{name}={json.dumps(a)}" for a in allowed)
                raise APIError(
                    f"{name}={json.dumps(value)} is not supported (only {only})", param=name
                )


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; usage comes once, at the end, either way


class _SamplerFields(_Strict):
    """Sampling fields of every endpoint (vLLM's and SGLang's extensions included)."""

    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, le=MAX_INT32)
    seed: int | None = Field(
        default=None, ge=0, le=MAX_SEED, validation_alias=AliasChoices("seed", "sampling_seed")
    )
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    neutral_values: ClassVar[dict[str, tuple[Any, ...]]] = {
        "skip_special_tokens": (True,),
        "spaces_between_special_tokens": (True,),
    }

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not s for s in stops):
            raise APIError("stop strings must be non-empty", param="stop")
        return stops

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams' fields that this request carries under their own names (in
        SamplingParams' order), less ``SET_BY_SERVER``: a field added there reaches every
        endpoint that takes it."""
        out = {}
        for field in dataclasses.fields(SamplingParams):
            if field.name not in SET_BY_SERVER:
                value = self._sampling_value(field.name)
                if value is not _ABSENT:
                    out[field.name] = value
        return out

    def _sampling_value(self, name: str) -> Any:
        """This request's value of the SamplingParams field ``name`` (``_ABSENT`` if it has no
        such field), in SamplingParams' shape."""
        if name == "stop":
            return self.stop_list
        if name == "stop_token_ids":
            return tuple(self.stop_token_ids or ())
        return getattr(self, name, _ABSENT)


class _OpenAIFields(_SamplerFields):
    """Fields shared by completions and chat."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1)  # choices, each sampled on its own (MAX_N at most)
    # vLLM's: lower runs first; None: the API key's default (--key-priority), else 0
    priority: int | None = Field(default=None, ge=-MAX_INT32 - 1, le=MAX_INT32)
    min_tokens: int = Field(default=0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1)
    # structured outputs (``pd.server.openai.structured``): at most one of these
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # Harmless: they never change the output.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @property
    def grammar(self) -> str:
        """The structured-output fields compiled into one grammar (a 400 if it does not
        compile)."""
        return grammar_of(
            {
                "response_format": self.response_format,
                "guided_json": self.guided_json,
                "guided_regex": self.guided_regex,
                "guided_choice": self.guided_choice,
                "guided_grammar": self.guided_grammar,
                "structured_outputs": self.structured_outputs,
            }
        )

    def check_supported(self) -> None:
        super().check_supported()
        if self.n > MAX_N:
            raise APIError(f"n={self.n} choices, at most {MAX_N} in one request", param="n")
        if self.seed is not None and self.seed + self.n - 1 > MAX_SEED:
            raise APIError(  # choice i samples with seed + i (vLLM's rule)
                f"seed={self.seed} with n={self.n}: choice {self.n - 1} would use seed "
                f"{self.seed + self.n - 1}, past the largest, {MAX_SEED}",
                param="seed",
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise APIError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                param="min_tokens",
            )
        if self.stream_options is not None and not self.stream:
            raise APIError(
                "stream_options is only allowed with stream=true", param="stream_options"
            )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def requested_max_tokens(self) -> int | None:
        """The completion's budget the request asks for (None: the rest of the context)."""
        return self.max_tokens


class CompletionRequest(_OpenAIFields):
    # One prompt: text or token ids. A one-element batch is unwrapped; larger batches -> 400.
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default; null = rest of context
    echo: bool = False
    # the sampled token's logprob and this many alternatives (OpenAI's legacy range: 0..5)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    neutral_values: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_OpenAIFields.neutral_values,
        "echo": (False,),
        "suffix": (None, ""),
    }

    def check_supported(self) -> None:
        if self.echo and self.logprobs is not None:
            raise APIError(
                "echo=true with logprobs is not supported: it needs the prompt's logprobs, and "
                "pd never runs a cached prompt prefix through the model again, so it has none",
                param="echo",
            )
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(
                f"best_of={self.best_of} with n={self.n} is not supported: pd returns every "
                "choice it samples (best_of must equal n, or be left out)",
                param="best_of",
            )
        super().check_supported()

    @property
    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise APIError(
                    f"batched prompts are not supported: got {len(prompt)} prompts, send one per request",
                    param="prompt",
                )
            prompt = prompt[0]
        if len(prompt) == 0:
            raise APIError("prompt must not be empty", param="prompt")
        return prompt  # type: ignore[return-value]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # handed to the chat template, which may use it
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, for the template
    tool_call_id: str | None = None  # a tool's answer: the call it answers

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def template_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.text}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class ChatCompletionRequest(_OpenAIFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # tool calls (``pd.server.openai.tools``)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for i, m in enumerate(self.messages):  # OpenAI's rules
            if (m.role == "tool") != (m.tool_call_id is not None):
                raise APIError(
                    f"messages[{i}]: tool_call_id belongs on a tool message, and a tool "
                    "message needs one",
                    param="messages",
                )
            if m.tool_calls is not None and m.role != "assistant":
                raise APIError(f"messages[{i}]: only an assistant has tool_calls", param="messages")
        if self.top_logprobs and not self.logprobs:  # OpenAI's rule
            raise APIError(
                f"top_logprobs={self.top_logprobs} needs logprobs=true", param="top_logprobs"
            )

    def _sampling_value(self, name: str) -> Any:
        if name == "logprobs":  # chat's is a switch, and top_logprobs the alternatives
            return (self.top_logprobs or 0) if self.logprobs else None
        return super()._sampling_value(name)

    @property
    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


class GenerateSamplingParams(_SamplerFields):
    max_new_tokens: int | None = Field(
        default=None, ge=1, validation_alias=AliasChoices("max_new_tokens", "max_tokens")
    )
    min_new_tokens: int = 0
    n: int = 1

    neutral_values: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_SamplerFields.neutral_values,
        "min_new_tokens": (0,),
        "n": (1,),
    }


class GenerateRequest(_Strict):
    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False
    cache_salt: str | None = Field(default=None, min_length=1)
    # SGLang's clients send these; accepted at their neutral values.
    return_logprob: bool = False
    logprob_start_len: int | None = None  # harmless without return_logprob
    lora_path: str | None = None
    return_routed_experts: bool = False
    rid: str | None = None  # harmless: the server names requests itself

    neutral_values: ClassVar[dict[str, tuple[Any, ...]]] = {
        "return_logprob": (False,),
        "lora_path": (None,),
        "return_routed_experts": (False,),
    }

    def check_supported(self) -> None:
        super().check_supported()
        self.sampling_params.check_supported()
