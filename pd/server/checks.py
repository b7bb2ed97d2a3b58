"""``RequestChecks``: what a parse thread checks of a request before the engine sees it.

The endpoints' ``prepare_*`` functions run in a parse thread (they tokenize and walk lists that
a hostile body can make long) and get only this object, never the event loop's state
(``pd.server.state``): the model and its context, the tokenizer, the server's input limits and
the API keys' groups and priorities. Each check raises an ``APIError`` (4xx) that names the
field; ``prepare`` is the steps every endpoint ends with.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from pd.core.sampling_params import LogitBias, SamplingParams
from pd.model.tokenizer import encode_chat, encode_prompt
from pd.server.config import ServerConfig
from pd.server.http.auth import cache_namespace
from pd.server.http.errors import APIError

_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")


class Prepared(NamedTuple):
    """A request parsed, checked and tokenized: ready for the engine."""

    prompt_ids: list[int]
    params: SamplingParams
    namespace: str
    stream: bool
    include_usage: bool = False
    n: int = 1  # choices
    tools: Any = None  # chat: the calls to parse out of the answer (pd.server.openai.tools.Tools)


class RequestChecks:
    """The checks of a request's fields against the model and the server's limits."""

    def __init__(
        self, tokenizer: Any, model_name: str, max_model_len: int, config: ServerConfig
    ) -> None:
        assert max_model_len >= 2, f"max_model_len must be >= 2, got {max_model_len}"
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.config = config
        self.vocab_size = len(tokenizer)
        self._key_group = config.key_group()
        self.key_priority = config.key_priorities()  # API key -> its requests' default priority
        # No token covers more characters than the longest one in the vocabulary, so a longer
        # text can never fit the context; refusing it spares its tokenization (seconds per MB).
        # Twice the bound, for tokenizers whose normalizer shortens text.
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = 2 * max_model_len * max(longest, 1)

    def prepare(
        self,
        prompt_ids: list[int],
        fields: Mapping[str, Any],
        *,
        param: str,
        max_tokens: int | None,
        logit_bias: Mapping[str, float] | None,
        priority: int | None,
        api_key: str | None,
        cache_salt: str | None,
        stream: bool,
        include_usage: bool = False,
        n: int = 1,
        tools: Any = None,
    ) -> Prepared:
        """The steps every endpoint ends with, once it has the prompt's ids and the request's
        ``sampling_kwargs()``: the completion budget (``max_tokens`` asked for; a 400 names
        ``param`` when the prompt does not fit), the priority (``priority_for``), the
        sampling params checked against the server's limits, the cache namespace."""
        budget = self.max_tokens_for(len(prompt_ids), max_tokens, param)
        params = self.sampling_params(
            fields, budget, logit_bias, self.priority_for(priority, api_key)
        )
        namespace = self.namespace(api_key, cache_salt)
        return Prepared(prompt_ids, params, namespace, stream, include_usage, n, tools)

    def priority_for(self, requested: int | None, api_key: str | None) -> int:
        """A request's priority: its own, else its API key's configured one, else 0. A key's
        configured priority is also a ceiling (lower runs first): its requests may ask to run
        later than it, never sooner, so one tenant cannot outrank what the operator gave it."""
        configured = self.key_priority.get(api_key) if api_key is not None else None
        if requested is None:
            return 0 if configured is None else configured
        return requested if configured is None else max(requested, configured)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                status_code=404,
                param="model",
                code="model_not_found",
            )

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise APIError(
                f"token ids must be in [0, {self.vocab_size}), got {bad[:5]}", param=param
            )

    def prompt_ids(self, ids: Sequence[int], param: str) -> list[int]:
        self._check_fits(len(ids), param)
        self.check_ids(ids, param)
        return list(ids)

    def encode(self, text: str, param: str) -> list[int]:
        if not text:
            raise APIError(f"{param} must not be empty", param=param)
        self._check_chars(len(text), param)
        return encode_prompt(self.tokenizer, text)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
    ) -> list[int]:
        limit = self.config.max_messages
        if len(messages) > limit:
            raise APIError(f"{len(messages)} messages, at most {limit}", param="messages")
        # every character the template is given counts: the messages' text, their tool calls
        # and the tools (their JSON text), so none of them is tokenized past the bound
        chars = sum(len(m["content"] or "") for m in messages)
        chars += sum(len(json.dumps(m["tool_calls"], default=str)) for m in messages
                     if m.get("tool_calls"))  # fmt: skip
        chars += len(json.dumps(tools, default=str)) if tools else 0
        self._check_chars(chars, "messages")
        try:
            return encode_chat(self.tokenizer, messages, tools)
        except Exception as e:  # no template, or the template rejects the conversation
            raise APIError(f"cannot apply the chat template: {e}", param="messages") from e

    def max_tokens_for(self, num_prompt_tokens: int, requested: int | None, param: str) -> int:
        """The completion budget; 400 when the prompt and the request do not fit the context."""
        limit = self.max_model_len
        self._check_fits(num_prompt_tokens, param)
        if requested is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + requested > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, "
                f"{requested} for the completion). Reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    def sampling_params(
        self,
        fields: Mapping[str, Any],
        max_tokens: int,
        logit_bias: Mapping[str, float] | None,
        priority: int = 0,
    ) -> SamplingParams:
        """``fields``: a request's ``sampling_kwargs()``; checked against the server's limits.
        ``priority``: ``priority_for``'s."""
        cfg = self.config
        stop, stop_ids = fields["stop"], fields["stop_token_ids"]
        if len(stop) > cfg.max_stop_strings:
            raise APIError(
                f"{len(stop)} stop strings, at most {cfg.max_stop_strings}", param="stop"
            )
        longest = max((len(s) for s in stop), default=0)
        if longest > cfg.max_stop_string_chars:
            raise APIError(
                f"a stop string of {longest} characters, at most {cfg.max_stop_string_chars}",
                param="stop",
            )
        if len(stop_ids) > cfg.max_stop_token_ids:
            raise APIError(
                f"{len(stop_ids)} stop_token_ids, at most {cfg.max_stop_token_ids}",
                param="stop_token_ids",
            )
        self.check_ids(stop_ids, "stop_token_ids")
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                logit_bias=self._logit_bias(logit_bias),
                priority=priority,
                **fields,
            )
        except ValueError as e:
            raise APIError(str(e)) from e

    def namespace(self, api_key: str | None, cache_salt: str | None) -> str:
        """The cache namespace of a request of ``api_key``: its key group's or its own with
        isolation (the default), else the shared one (or the salt's)."""
        self._check_salt(cache_salt)
        if not self.config.isolate_cache_per_key or api_key is None:
            return cache_namespace(None, cache_salt)
        return cache_namespace(api_key, cache_salt, self._key_group.get(api_key))

    def group_namespace(self, group: str, cache_salt: str | None) -> str:
        """The namespace a request of key group ``group``'s keys gets (an admin's warmup)."""
        self._check_salt(cache_salt)
        groups = sorted(set(self._key_group.values()))
        if not self.config.isolate_cache_per_key or group not in groups:
            raise APIError(
                f"key_group {group!r} is not one of this server's {len(groups)} key groups"
                + ("" if self.config.isolate_cache_per_key else " (isolate_cache_per_key is off)"),
                param="key_group",
            )
        return cache_namespace(None, cache_salt, group)

    def _check_salt(self, cache_salt: str | None) -> None:
        limit = self.config.max_cache_salt_chars
        if cache_salt is not None and len(cache_salt) > limit:
            raise APIError(
                f"cache_salt has {len(cache_salt)} characters, at most {limit}", param="cache_salt"
            )

    def _logit_bias(self, bias: Mapping[str, float] | None) -> LogitBias:
        if not bias:
            return ()
        limit = self.config.max_logit_bias
        if len(bias) > limit:
            raise APIError(
                f"logit_bias has {len(bias)} tokens, at most {limit}", param="logit_bias"
            )
        pairs: dict[int, float] = {}
        for key, value in bias.items():
            token = int(key) if _TOKEN_ID_KEY.fullmatch(key) else -1
            if not 0 <= token < self.vocab_size:
                raise APIError(
                    f"logit_bias keys must be token ids in [0, {self.vocab_size}), got {key!r}",
                    param="logit_bias",
                )
            if token in pairs:
                raise APIError(f"logit_bias names token {token} twice", param="logit_bias")
            if not (math.isfinite(value) and -100.0 <= value <= 100.0):
                raise APIError(
                    f"logit_bias values must be in [-100, 100], got {value} for token {token}",
                    param="logit_bias",
                )
            pairs[token] = value
        return tuple(sorted(pairs.items()))

    def _check_fits(self, num_prompt_tokens: int, param: str) -> None:
        if num_prompt_tokens >= self.max_model_len:
            raise APIError(
                f"The prompt has {num_prompt_tokens} tokens, but this model's maximum context "
                f"length is {self.max_model_len} tokens and at least one must be left for the "
                f"completion.",
                param=param,
                code="context_length_exceeded",
            )

    def _check_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise APIError(
                f"The prompt has {num_chars} characters: more tokens than this model's maximum "
                f"context length of {self.max_model_len} tokens (no token of this tokenizer is "
                f"longer than {self.max_prompt_chars // (2 * self.max_model_len)} characters).",
                param=param,
                code="context_length_exceeded",
            )
