"""``ServerConfig``: the HTTP server's access control, admission, input limits, deadlines,
connections and TLS."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pd.cache.tenants import check_group_name
from pd.core.options import option

_MIB = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    """Defaults serve ordinary clients (the openai client, SGLang's and vLLM's benchmarks)."""

    api_key: tuple[str, ...] = option(
        (),
        "a key clients must send as `Authorization: Bearer <key>` (repeatable; also "
        "PD_API_KEY, comma-separated); none: the API is open",
    )
    admin_api_key: tuple[str, ...] = option(
        (),
        "a key for the admin API (/admin/*, /metrics) and all a tenant's may use (repeatable; "
        "also PD_ADMIN_API_KEY); with --api-key alone nobody may use the admin API",
    )
    metrics_no_auth: bool = option(False, "serve /metrics without a key (for scrapers)")
    max_inflight_per_key: int = option(
        0, "requests one API key may have in flight (queued ones too); more get 429 (0: no limit)"
    )
    max_tokens_per_minute_per_key: int = option(
        0,
        "prompt + completion tokens one API key may use in any 60 s; past it, 429 with "
        "Retry-After (0: no limit)",
    )
    key_priority: tuple[str, ...] = option(
        (),
        "KEY=PRIORITY: the priority of API key KEY's requests (repeatable; an integer, lower "
        "runs first, as vLLM's priority; a request may ask to run later, never sooner; "
        "others: 0, or their own)",
    )
    isolate_cache_per_key: bool = option(
        True,
        "with API keys: requests share cached prefixes (and see cached_tokens) only with "
        "requests of the same key or key group (a key file's `KEY GROUP` lines); off: all keys "
        "share one cache, and can tell by cached_tokens what another sent",
    )
    # (key, group) pairs from the key files' ``KEY GROUP`` lines: a group's keys share a
    # cache namespace and a share of the cache (``--cache-share``); no flag of its own
    key_groups: tuple[tuple[str, str], ...] = ()
    max_inflight_requests: int = option(512, "requests generating at once; more wait in a queue")
    max_queued_requests: int = option(4096, "requests waiting for admission; more get 429")
    request_timeout: float = option(600.0, "seconds from arrival until a request is aborted")
    max_body_bytes: int = option(8 * _MIB, "largest request body; larger gets 413")
    max_messages: int = option(1024, "messages in one chat request")
    max_stop_strings: int = option(32, "stop strings in one request")
    max_stop_string_chars: int = option(1024, "characters in one stop string")
    max_stop_token_ids: int = option(1024, "stop_token_ids in one request")
    max_logit_bias: int = option(1024, "tokens in one request's logit_bias")
    max_cache_salt_chars: int = option(1024, "characters in a cache_salt")
    num_parse_threads: int = option(4, "threads that parse, template and tokenize requests")
    stream_write_timeout_s: float = option(
        30.0,
        "a client that takes none of its response's bytes for this long (its socket buffers "
        "full) is cut off, and its request aborted",
    )
    max_stream_buffer_bytes: int = option(
        512 << 10,
        "bytes of a stream's answer the server holds for a client that reads slower than the "
        "engine generates, twice: as text for the client's socket, and behind it as the "
        "nodes' token messages (all its choices); a request that far ahead of its client is "
        "paused on its node until the client catches up",
    )
    stream_pause_timeout_s: float = option(
        60.0,
        "a stream paused because its client fell max_stream_buffer_bytes behind is ended "
        "(an error event; its request aborted, its KV freed) when its client has not caught up "
        "within this many seconds",
    )
    max_released_stream_bytes: int = option(
        128 * _MIB,
        "bytes held for slow clients by all streams whose generation ended, together: such a "
        "stream gives its admission place back when its unsent bytes fit under this",
    )
    body_read_timeout_s: float = option(
        30.0,
        "seconds to receive a request's whole body, which is read before admission; slower "
        "gets 408 and its connection closed",
    )
    max_body_bytes_in_flight: int = option(
        256 * _MIB,
        "bytes of request bodies being received at once, all connections together (a "
        "Content-Length counts in full from the start); a body that would pass it gets 429",
    )
    header_timeout_s: float = option(
        10.0,
        "seconds for a request's head (request line and headers) to arrive, from the "
        "connection's opening or the first byte after its previous answer; slower gets 408 "
        "and its connection closed",
    )
    max_connections: int = option(
        0,
        "open HTTP connections; one more is answered 503 and closed at once (0: half the "
        "open-file limit, which pd serve raises to its hard limit, at most 10,000)",
    )
    shutdown_grace_s: float = option(
        30.0,
        "on SIGTERM: stop admitting (503), let requests in flight finish, exit within this "
        "many seconds (what still runs near the end is cut off: finish reason abort)",
    )
    ssl_certfile: str | None = option(None, "serve HTTPS: the certificate (PEM; with ssl_keyfile)")
    ssl_keyfile: str | None = option(None, "serve HTTPS: the private key (PEM)")

    def key_group(self) -> dict[str, str]:
        """key -> its key group, for the keys in one."""
        return dict(self.key_groups)

    def __post_init__(self) -> None:
        object.__setattr__(self, "api_key", tuple(self.api_key))
        object.__setattr__(self, "admin_api_key", tuple(self.admin_api_key))
        for key in (*self.api_key, *self.admin_api_key):
            if not key or not key.isascii() or not key.isprintable() or " " in key or "," in key:
                raise ValueError(
                    f"an API key must be non-empty printable ASCII without spaces or commas; "
                    f"got one of {len(key)} characters that is not"
                )
        object.__setattr__(self, "key_priority", tuple(self.key_priority))
        self.key_priorities()  # raises on a bad entry
        object.__setattr__(self, "key_groups", tuple(tuple(p) for p in self.key_groups))
        groups: dict[str, str] = {}
        for key, group in self.key_groups:
            check_group_name(group)
            if key not in self.api_key and key not in self.admin_api_key:
                raise ValueError(f"key group {group!r} names a key that is not an API key")
            if groups.setdefault(key, group) != group:
                raise ValueError(f"a key is in two key groups, {groups[key]!r} and {group!r}")
        for name in ("max_inflight_per_key", "max_tokens_per_minute_per_key"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{name} must be >= 0 (0: no limit), got {value}")
            if value and not (self.api_key or self.admin_api_key):
                raise ValueError(f"{name} needs at least one api_key or admin_api_key")
        for name in (
            "max_inflight_requests", "max_body_bytes", "max_messages", "max_stop_strings",
            "max_stop_string_chars", "max_stop_token_ids", "max_logit_bias",
            "max_cache_salt_chars", "num_parse_threads", "max_body_bytes_in_flight",
            "max_stream_buffer_bytes",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_queued_requests", "max_connections", "max_released_stream_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_body_bytes_in_flight < self.max_body_bytes:
            raise ValueError(
                f"max_body_bytes_in_flight ({self.max_body_bytes_in_flight}) must be at least "
                f"max_body_bytes ({self.max_body_bytes})"
            )
        for name in (
            "request_timeout", "stream_write_timeout_s", "stream_pause_timeout_s",
            "body_read_timeout_s",
            "header_timeout_s", "shutdown_grace_s",
        ):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("TLS needs both ssl_certfile and ssl_keyfile, or neither")
        for path in (self.ssl_certfile, self.ssl_keyfile):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"no such TLS file: {path}")

    def key_priorities(self) -> dict[str, int]:
        """``key_priority`` as API key -> default priority; ValueError for a malformed entry
        or one that names no configured key (never echoing a key)."""
        keys = {*self.api_key, *self.admin_api_key}
        out: dict[str, int] = {}
        for i, entry in enumerate(self.key_priority):
            key, sep, value = entry.rpartition("=")
            try:
                priority = int(value)
            except ValueError:
                priority = None
            if not sep or priority is None or not -(2**31) <= priority < 2**31:
                raise ValueError(
                    f"key_priority entry {i} must be KEY=PRIORITY with an integer priority "
                    "in [-2^31, 2^31)"
                )
            if key not in keys:
                raise ValueError(
                    f"key_priority entry {i} names a key that is neither an api_key nor an "
                    f"admin_api_key ({len(keys)} are configured)"
                )
            out[key] = priority
        return out
