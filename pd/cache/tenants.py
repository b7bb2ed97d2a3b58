"""Tenants of the prefix cache, and their shares of it under pressure.

A namespace's first ``/``-part names its tenant when it is a key's (``k...``) or a key group's
(``g...``), as ``pd.server.http.auth.cache_namespace`` builds them with caches isolated per key
(the default with API keys): every namespace of one key group, salted ones included, belongs to
one tenant. Anything else (``""``, a bare salt's ``s...``) belongs to the shared tenant ``""``.

Every tree node lives in exactly one namespace, so a node's ``last_access`` is its tenant's
access time; what fair eviction adds is one least-recently-used order per tenant
(``RadixTree.evict_order`` with ``TenantShares``): the tenant holding the most of the tier per
unit of its weight gives up its own least recent leaf first, so a tenant flooding the pool with
unique prompts evicts its own prefixes, not another's hot system prompt. With one tenant it is
exactly the global LRU order.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

_HEX_CHARS = 32  # 128 bits, as the key namespaces' HMACs
_TENANT_KINDS = ("k", "g")  # a key's namespace, a key group's


def tenant_of(namespace: str) -> str:
    """The tenant owning ``namespace``: its first part for a key's or a group's, else ""."""
    head = namespace.split("/", 1)[0]
    return head if head[:1] in _TENANT_KINDS else ""


def group_namespace(group: str) -> str:
    """The namespace (and tenant) of key group ``group``: a hash of its name, the same on every
    node and across restarts (the disk tier keys chunks by namespace)."""
    check_group_name(group)
    digest = hashlib.sha256(b"pd.cache-group\0" + group.encode()).hexdigest()
    return "g" + digest[:_HEX_CHARS]


def check_group_name(group: str) -> None:
    if (
        not group
        or not group.isascii()
        or not group.isprintable()
        or any(c in group for c in " =,")
    ):
        raise ValueError(
            f"a key group's name must be non-empty printable ASCII without spaces, '=' or ','; "
            f"got {group!r}"
        )


class TenantShares:
    """Each tenant's weight in fair eviction: 1 unless a key group's is set (``GROUP=WEIGHT``)."""

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self._weights = dict(weights or {})
        for tenant, w in self._weights.items():
            assert math.isfinite(w) and w > 0, f"tenant {tenant!r} has weight {w}"

    @classmethod
    def parse(cls, entries: Sequence[str]) -> TenantShares:
        """From ``("team-a=3", "batch=0.5")``; raises ValueError naming a malformed entry."""
        weights: dict[str, float] = {}
        for entry in entries:
            group, sep, value = entry.partition("=")
            try:
                weight = float(value)
            except ValueError:
                weight = math.nan
            if not sep or not math.isfinite(weight) or weight <= 0:
                raise ValueError(f"a cache share is GROUP=WEIGHT with a weight > 0, got {entry!r}")
            tenant = group_namespace(group)
            if tenant in weights:
                raise ValueError(f"key group {group!r} has two cache shares")
            weights[tenant] = weight
        return cls(weights)

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)
