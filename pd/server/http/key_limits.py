"""Per-API-key limits on the generation endpoints (what gateways do in front of an engine):

- requests in flight (``--max-inflight-per-key``): counted from the moment a request passes
  authentication until its response is over (queued for admission, streaming: all count), so
  one key can neither take every admission place nor the whole queue. A request of ``n``
  choices counts ``n`` once its body says so (``WIDEN_SCOPE``), as n requests would;
- tokens per minute (``--max-tokens-per-minute-per-key``): prompt tokens when the request
  starts on the engine, completion tokens as they come; a request is refused while the key's
  tokens of the last 60 s are at the limit. What a request may still produce counts too: once
  its prompt is read (``TOKEN_BUDGET_SCOPE``), it reserves its prompt and ``n * max_tokens``
  against the key's tokens left in the window (the window's and the other requests'
  reservations taken off), its ``max_tokens`` lowered to fit (it ends with ``finish_reason:
  "length"`` there), a 429 when not one token a choice fits; as tokens come they move from
  the reservation to the window, and what is left is given back when it ends. So the key's
  tokens in any window stay within its limit, whatever ``n`` and ``max_tokens`` it asks.

Either refusal is a 429 in OpenAI's shape with ``Retry-After``: 1 s for requests in flight, the
seconds until enough of the key's tokens have left the window for tokens. The window is 60
one-second buckets per key, so a key's bookkeeping is bounded whatever its traffic.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from pd.server.http.auth import API_KEY_SCOPE
from pd.server.http.errors import APIError, rate_limited
from pd.server.metrics import ServerMetrics

WINDOW_S = 60
TOKEN_METER_SCOPE = "pd.token_meter"  # the ASGI scope entry: a Callable[[int], None]
# the ASGI scope entry: a Callable[[int, int, int], int]: (prompt tokens, choices, max_tokens)
# -> the max_tokens the key's tokens left allow (reserved), or the 429 that refuses it
TOKEN_BUDGET_SCOPE = "pd.token_budget"
# the ASGI scope entry: a Callable[[int], None] that counts a request as that many in flight
# (its n choices), or raises the 429 that refuses it
WIDEN_SCOPE = "pd.key_widen"
# the paths that generate (and so count); each answers one request with one response
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/generate"})


class TokenWindow:
    """Tokens counted in the last ``WINDOW_S`` seconds, in one-second buckets: a token counted
    at time t leaves the window at ``floor(t) + WINDOW_S``."""

    def __init__(self) -> None:
        self._buckets: deque[list[int]] = deque()  # [second, tokens], oldest first
        self.num_tokens = 0  # in the window as of the last add() or expire()

    def add(self, num_tokens: int, now: float) -> None:
        second = math.floor(now)
        self.expire(now)
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += num_tokens
        else:
            self._buckets.append([second, num_tokens])
        self.num_tokens += num_tokens

    def expire(self, now: float) -> None:
        while self._buckets and self._buckets[0][0] + WINDOW_S <= now:
            self.num_tokens -= self._buckets.popleft()[1]

    def seconds_until_below(self, limit: int, now: float) -> float:
        """0 when fewer than ``limit`` tokens are in the window, else the seconds until so."""
        self.expire(now)
        remaining, wait = self.num_tokens, 0.0
        for second, num_tokens in self._buckets:
            if remaining < limit:
                break
            remaining -= num_tokens
            wait = second + WINDOW_S - now  # once this bucket has left, ``remaining`` are in
        return wait


class KeyLimiter:
    """The per-key counts (``max_*`` 0: that limit is off). All on the event loop."""

    def __init__(
        self,
        max_inflight: int,
        max_tokens_per_minute: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_inflight = max_inflight
        self.max_tokens_per_minute = max_tokens_per_minute
        self.clock = clock
        self.num_inflight: dict[str, int] = {}
        self._windows: dict[str, TokenWindow] = {}
        self.num_reserved: dict[str, int] = {}  # key -> tokens its running requests may add

    @property
    def is_enabled(self) -> bool:
        return bool(self.max_inflight or self.max_tokens_per_minute)

    def begin(self, key: str) -> None:
        """Count a request of ``key`` in flight, or raise the 429 that refuses it."""
        if self.max_inflight and self.num_inflight.get(key, 0) >= self.max_inflight:
            raise rate_limited(
                f"this API key has {self.max_inflight} requests in flight, its limit; retry "
                "when one has finished",
                "key_inflight_limit",
                1,
            )
        if self.max_tokens_per_minute and key in self._windows:
            now = self.clock()
            window = self._windows[key]
            wait = window.seconds_until_below(self.max_tokens_per_minute, now)
            if wait > 0:
                retry_after = max(1, math.ceil(wait))
                raise rate_limited(
                    f"this API key used {window.num_tokens} tokens in the last {WINDOW_S} s, "
                    f"its limit is {self.max_tokens_per_minute} per minute; retry in "
                    f"{retry_after} s",
                    "key_token_limit",
                    retry_after,
                )
        self.num_inflight[key] = self.num_inflight.get(key, 0) + 1

    def widen(self, key: str, num_choices: int) -> None:
        """A request ``begin`` counted as one asks for ``num_choices``: count the rest, or
        raise the 429 that refuses it (the one stays counted until ``end``)."""
        extra = num_choices - 1
        if not extra:
            return
        have = self.num_inflight[key] - 1  # the key's others
        if self.max_inflight and have + num_choices > self.max_inflight:
            raise rate_limited(
                f"this request asks for n={num_choices} choices and this API key has {have} "
                f"in flight besides; its limit is {self.max_inflight} in flight (each choice "
                "counts); retry when some have finished, or ask for fewer",
                "key_inflight_limit",
                1,
            )
        self.num_inflight[key] += extra

    def end(self, key: str, num_choices: int = 1) -> None:
        """The request ``begin`` counted (and ``widen`` widened to ``num_choices``) is over
        (exactly once per ``begin`` that passed)."""
        n = self.num_inflight[key] - num_choices
        if n:
            self.num_inflight[key] = n
        else:
            del self.num_inflight[key]

    def add_tokens(self, key: str, num_tokens: int) -> None:
        if self.max_tokens_per_minute and num_tokens:
            self._windows.setdefault(key, TokenWindow()).add(num_tokens, self.clock())

    def reserve(self, key: str, num_prompt: int, num_choices: int, max_tokens: int) -> int:
        """The max_tokens a request of ``key`` may have (at most ``max_tokens``) so that its
        prompt and every choice's tokens fit the key's tokens left in the window, reserved
        for it (``release`` gives back what it does not use); the 429 (or a 400 where even an
        empty window could not hold it) that refuses it."""
        if not self.max_tokens_per_minute:
            return max_tokens
        limit, reserved = self.max_tokens_per_minute, self.num_reserved.get(key, 0)
        if num_prompt + num_choices > limit:
            raise APIError(
                f"this request needs at least {num_prompt + num_choices} tokens (its prompt and "
                f"one a choice); this API key's limit is {limit} per minute",
                param="messages",
            )
        left = limit - self.num_tokens(key) - reserved
        allowed = min(max_tokens, (left - num_prompt) // num_choices)
        if allowed < 1:
            now = self.clock()
            window = self._windows.get(key)
            below = limit - reserved - num_prompt - num_choices + 1
            wait = window.seconds_until_below(max(below, 1), now) if window else 0.0
            retry_after = max(1, math.ceil(wait))
            raise rate_limited(
                f"this API key has {max(left, 0)} of its {limit} tokens per minute left (its "
                f"running requests may still produce {reserved}); this request needs "
                f"{num_prompt + num_choices} (its prompt and one a choice); retry in "
                f"{retry_after} s",
                "key_token_limit",
                retry_after,
            )
        self.num_reserved[key] = reserved + num_prompt + num_choices * allowed
        return allowed

    def release(self, key: str, num_tokens: int) -> None:
        """Give back ``num_tokens`` of ``key``'s reservation (produced, or never to be)."""
        if num_tokens:
            left = self.num_reserved[key] - num_tokens
            assert left >= 0, (key, left)
            if left:
                self.num_reserved[key] = left
            else:
                del self.num_reserved[key]

    def num_tokens(self, key: str) -> int:
        """``key``'s tokens in the window now."""
        window = self._windows.get(key)
        if window is None:
            return 0
        window.expire(self.clock())
        return window.num_tokens


class KeyLimitMiddleware:
    """Applies a ``KeyLimiter`` to the generation paths of requests that carry a key (inside
    ``AuthMiddleware``), and hands the route a meter for the request's tokens
    (``TOKEN_METER_SCOPE``)."""

    def __init__(self, app: ASGIApp, limiter: KeyLimiter, metrics: ServerMetrics) -> None:
        self.app = app
        self.limiter = limiter
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = scope.get(API_KEY_SCOPE)
        if scope["type"] != "http" or key is None or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            self.limiter.begin(key)
        except APIError as e:
            reason = "key_inflight" if e.code == "key_inflight_limit" else "key_tokens"
            self.metrics.rejected.labels(reason=reason).inc()
            await e.response()(scope, receive, send)
            return
        account = _TokenAccount(self.limiter, key)
        scope[TOKEN_METER_SCOPE] = account.add
        scope[TOKEN_BUDGET_SCOPE] = account.reserve
        held = [1]

        def widen(num_choices: int) -> None:
            assert held == [1], held  # once a request
            try:
                self.limiter.widen(key, num_choices)
            except APIError:
                self.metrics.rejected.labels(reason="key_inflight").inc()
                raise
            held[0] = num_choices

        scope[WIDEN_SCOPE] = widen
        try:
            await self.app(scope, receive, send)
        finally:
            account.close()
            self.limiter.end(key, held[0])


class _TokenAccount:
    """One request's tokens against its key: reserved once its prompt is read, moved to the
    window as they come, the rest given back when it ends."""

    def __init__(self, limiter: KeyLimiter, key: str) -> None:
        self.limiter = limiter
        self.key = key
        self.num_reserved = 0

    def reserve(self, num_prompt: int, num_choices: int, max_tokens: int) -> int:
        assert self.num_reserved == 0, "reserved once a request"
        allowed = self.limiter.reserve(self.key, num_prompt, num_choices, max_tokens)
        if self.limiter.max_tokens_per_minute:
            self.num_reserved = num_prompt + num_choices * allowed
        return allowed

    def add(self, num_tokens: int) -> None:
        self.limiter.add_tokens(self.key, num_tokens)
        moved = min(num_tokens, self.num_reserved)
        self.num_reserved -= moved
        self.limiter.release(self.key, moved)

    def close(self) -> None:
        self.limiter.release(self.key, self.num_reserved)
        self.num_reserved = 0
