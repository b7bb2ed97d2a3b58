"""API keys and the prefix-cache namespace of a request.

A request's namespace scopes prefix-cache sharing on the engine (requests share cached
prefixes only within one). It is derived, never copied, from the tenant's API key (with
``isolate_cache_per_key``) and the request's ``cache_salt``: each part is an HMAC keyed by the
API key, so a key never appears in it in clear (namespaces travel to nodes and into cache
events), two keys never share a namespace, and salts of different keys never collide.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from hashlib import sha256

_HEX_CHARS = 32  # 128 bits of each HMAC
API_KEY_SCOPE = "pd.api_key"  # the ASGI scope entry holding the key a request carried


class ApiKeys:
    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = [k.encode() for k in keys]

    @property
    def is_enabled(self) -> bool:
        return bool(self._keys)

    def match(self, authorization: bytes | None) -> str | None:
        """The configured key that ``Authorization: Bearer <key>`` carries, else None.
        Compared in constant time against every key (no early exit on a match)."""
        if authorization is None:
            return None
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        given = token.strip()
        found: bytes | None = None
        for key in self._keys:
            if hmac.compare_digest(given, key):
                found = key
        return None if found is None else found.decode()


def cache_namespace(api_key: str | None, cache_salt: str | None) -> str:
    """ "" (the shared namespace) when neither part is given. ``api_key`` is passed only when
    the server isolates caches per key."""
    secret = (api_key or "").encode()
    parts = []
    if api_key is not None:
        parts.append("k" + _hmac(secret, b"pd.cache-namespace"))
    if cache_salt is not None:
        parts.append("s" + _hmac(secret, b"pd.cache-salt\0" + cache_salt.encode()))
    return "/".join(parts)


def _hmac(key: bytes, msg: bytes) -> str:
    return hmac.new(key, msg, sha256).hexdigest()[:_HEX_CHARS]
