"""API keys, their roles, and the prefix-cache namespace of a request.

Keys have a role: a *tenant* key (``--api-key``, ``--api-key-file``, ``PD_API_KEY``) may use
the generation endpoints, ``/v1/models`` and the API's documents; an *admin* key
(``--admin-api-key``, ``--admin-api-key-file``, ``PD_ADMIN_API_KEY``) may do that and operate
the cluster too: the admin API ``/admin/*``, ``/metrics`` (per-node labels) and the node list on
``/ready``. With no key of either kind the API is open to all, admin routes included (``--host``
defaults to loopback for that reason, and ``pd serve`` warns on another); with tenant keys but
no admin key nobody may use the admin routes.

A request's namespace scopes prefix-cache sharing on the engine (requests share cached
prefixes only within one). It is derived, never copied, from the tenant's API key or key group
(with ``isolate_cache_per_key``, the default) and the request's ``cache_salt``. A key's part is
an HMAC keyed by the key, so a key never appears in clear (namespaces travel to nodes and into
cache events) and two keys never share a namespace; keys an admin puts in one group (a line
``KEY GROUP`` of a key file) share the group's namespace (``pd.cache.tenants.group_namespace``,
a hash of its name). A salt's part is an HMAC keyed by the key (or the group), so salts of
different tenants never collide. The namespace's first part names the tenant that fair eviction
(``pd.cache.tenants``) weighs.
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Sequence
from hashlib import sha256
from typing import NamedTuple

from pd.cache.tenants import group_namespace

_HEX_CHARS = 32  # 128 bits of each HMAC
API_KEY_SCOPE = "pd.api_key"  # the ASGI scope entry holding the key a request carried
ROLE_SCOPE = "pd.role"  # ... and its Role (ADMIN for everybody while the API is open)


class Role(enum.Enum):
    TENANT = "tenant"
    ADMIN = "admin"


class KeyMatch(NamedTuple):
    key: str
    role: Role


class ApiKeys:
    def __init__(self, tenant_keys: Sequence[str], admin_keys: Sequence[str] = ()) -> None:
        # a key given both ways is an admin key
        self._keys = [(k.encode(), Role.TENANT) for k in tenant_keys if k not in admin_keys]
        self._keys += [(k.encode(), Role.ADMIN) for k in admin_keys]
        self.has_admin_keys = bool(admin_keys)

    @property
    def is_enabled(self) -> bool:
        return bool(self._keys)

    def match(self, authorization: bytes | None) -> KeyMatch | None:
        """The configured key that ``Authorization: Bearer <key>`` carries, with its role, else
        None. Compared in constant time against every key (no early exit on a match)."""
        if authorization is None:
            return None
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        given = token.strip()
        found: KeyMatch | None = None
        for key, role in self._keys:
            if hmac.compare_digest(given, key):
                found = KeyMatch(key.decode(), role)
        return found


def cache_namespace(api_key: str | None, cache_salt: str | None, group: str | None = None) -> str:
    """ "" (the shared namespace) when no part is given. ``api_key`` and its key ``group`` are
    passed only when the server isolates caches per key; a group's keys share its namespace."""
    parts = []
    if group is not None:
        secret = b"pd.cache-group\0" + group.encode()  # no key has a NUL: never a key's
        parts.append(group_namespace(group))
    else:
        secret = (api_key or "").encode()
        if api_key is not None:
            parts.append("k" + _hmac(secret, b"pd.cache-namespace"))
    if cache_salt is not None:
        parts.append("s" + _hmac(secret, b"pd.cache-salt\0" + cache_salt.encode()))
    return "/".join(parts)


def _hmac(key: bytes, msg: bytes) -> str:
    return hmac.new(key, msg, sha256).hexdigest()[:_HEX_CHARS]
