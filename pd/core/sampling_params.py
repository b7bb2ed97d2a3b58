"""Per-request sampling parameters: validated once, and sent to nodes as they are.

``SamplingParams`` is the one shape of these fields everywhere: the HTTP layer builds it, the
engine and the nodes read it, and msgspec encodes it inside the wire messages (``pd.core.messages``) and
re-runs ``__post_init__`` when a node decodes it, so a node never trusts an unchecked value.
Integer fields are bounded to what the wire (msgpack int64/uint64), torch's
``Generator.manual_seed`` and int32 index tensors can carry.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

# Below this a temperature is greedy (as in vLLM): dividing logits by it would overflow.
MIN_TEMPERATURE = 1e-5
MAX_INT32 = 2**31 - 1
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes int64 (and uint64); keep it signed
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100]
# A safety net for decoded messages; the server's own (configurable) limit is far lower.
MAX_LOGIT_BIAS_TOKENS = 1 << 18
MAX_PENALTY = 2.0  # OpenAI's range of presence_penalty and frequency_penalty: [-2, 2]
MAX_LOGPROBS = 20  # OpenAI's top_logprobs: 0..20 (completions' logprobs: 0..5, the server's)
# A safety net for decoded messages; the server's request body limit is far lower.
MAX_GRAMMAR_CHARS = 1 << 22

LogitBias = tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class SamplingParams:
    """What to generate. Defaults follow vLLM/OpenAI (temperature 1.0, top_p 1.0, no top-k).

    ``logit_bias``: (token id, bias) pairs sorted by id, each bias added to that token's logit
    before sampling (greedy included). ``min_tokens``: until that many tokens are out, EOS (unless
    ``ignore_eos``) and ``stop_token_ids`` cannot be sampled (as vLLM).

    Penalties (vLLM's definitions, greedy included; ``pd.executor.penalties``):
    ``repetition_penalty`` r > 0 divides the positive logits and multiplies the negative ones of
    every token seen in the prompt or the output; ``frequency_penalty`` f subtracts f x (times
    the token is in the output); ``presence_penalty`` p subtracts p once from each token in the
    output. ``min_p``: after the temperature, tokens whose probability is below min_p x the
    top token's are dropped (sampled requests only: it never changes the argmax).
    ``logprobs``: None, or how many alternatives (0..20) to return with each token's logprob.
    ``grammar``: an llguidance grammar (its JSON text, e.g. a JSON schema's) every sampled
    token must follow, EOS only where it accepts (``pd.executor.grammar``); "": none.

    ``priority`` is no sampling field but travels with them to every queue: vLLM's meaning
    (lower runs first, default 0; ``pd.core.priority``)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logit_bias: LogitBias = ()
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logprobs: int | None = None
    priority: int = 0
    grammar: str = ""

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1, MAX_INT32)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):  # rejects NaN
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, -1, MAX_INT32)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, MAX_INT32)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:  # also rejects NaN
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(
                f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_int("priority", self.priority, -MAX_INT32 - 1, MAX_INT32)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if not isinstance(self.grammar, str) or len(self.grammar) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"grammar must be a string of at most {MAX_GRAMMAR_CHARS} characters")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _checked_logit_bias(self.logit_bias))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Whether sampling needs the request's token counts (``pd.executor.penalties``)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")


def _checked_logit_bias(pairs: Iterable[tuple[int, float]]) -> LogitBias:
    out = tuple((token, float(bias)) for token, bias in pairs)
    if len(out) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"logit_bias has {len(out)} tokens, at most {MAX_LOGIT_BIAS_TOKENS}")
    for i, (token, bias) in enumerate(out):
        _check_int("logit_bias token", token, 0, MAX_INT32)
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # also rejects NaN
            raise ValueError(
                f"logit_bias of token {token} must be in [-{MAX_LOGIT_BIAS:g}, "
                f"{MAX_LOGIT_BIAS:g}], got {bias}"
            )
        if i and token <= out[i - 1][0]:
            raise ValueError("logit_bias tokens must be unique and in increasing order")
    return out
