"""Endpoints (``tcp://host:port``) that one cluster member may tell another to dial.

A wildcard host (``0.0.0.0``) can be bound but never dialled from another machine, so it is
never advertised; hosts are IPv4 addresses or DNS names.
"""

from __future__ import annotations

import ipaddress
import re

WILDCARD_HOSTS = frozenset({"0.0.0.0", "*", "::", ""})
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")
_ENDPOINT = re.compile(r"tcp://([^:/]*):([0-9]{1,5})")


def is_wildcard(host: str) -> bool:
    return host in WILDCARD_HOSTS


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_host(host: str) -> str:
    """``host`` if another member could dial it (not a wildcard, a plausible name or IPv4)."""
    if is_wildcard(host) or _HOST.fullmatch(host) is None:
        raise ValueError(f"{host!r} is not a host to dial (an IPv4 address or a DNS name)")
    return host


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """(host, port) of a ``tcp://host:port`` another member could dial; ValueError if not."""
    m = _ENDPOINT.fullmatch(endpoint)
    if m is None:
        raise ValueError(f"{endpoint[:200]!r} is not a tcp://host:port endpoint")
    port = int(m.group(2))
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} of {endpoint!r} is not in [1, 65535]")
    return check_host(m.group(1)), port
