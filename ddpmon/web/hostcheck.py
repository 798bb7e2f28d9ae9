"""Which ``Host`` and ``Origin`` a request to the daemon may carry: the defence against DNS
rebinding and against cross-origin requests from a browser on the node.

A web page on ``evil.example`` whose name is rebound to 127.0.0.1 reaches the daemon from the
operator's own browser with ``Host: evil.example``; a page that simply posts to
``http://127.0.0.1:7469`` sends ``Origin: http://evil.example``. Neither name is this daemon's,
so the first gets 421 (Misdirected Request) and the second 403. Allowed names: loopback
(``localhost``, ``127.0.0.1``, ``::1``), the address the connection arrived on, the bind
address, this host's name and FQDN, the node label, and the names given with
``--allowed-host`` (a DNS alias or load balancer name Prometheus uses). Clients that send no
``Origin`` (Prometheus, curl, the agents) are not browsers and pass the origin check.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "localhost.localdomain"})


def host_names(bind: str, node: str | None, extra: Iterable[str] = ()) -> frozenset[str]:
    """The names a request's Host may carry besides the connection's own address."""
    names = set(LOOPBACK_NAMES)
    if bind not in ("", "0.0.0.0", "::"):
        names.add(bind.lower())
    for name in (socket.gethostname(), socket.getfqdn(), node or "", *extra):
        if name:
            names.add(name.strip().lower().rstrip("."))
    return frozenset(names)


def split_host(value: str) -> str | None:
    """The host part of a Host header value (``[::1]:7469`` -> ``::1``), lowercased; None when
    it is no host at all."""
    value = value.strip().lower()
    if not value or any(c in value for c in "/@?#\\ \t"):
        return None
    if value.startswith("["):
        end = value.find("]")
        if end < 0 or (value[end + 1:] and not _port(value[end + 1:])):
            return None
        return value[1:end]
    host, sep, port = value.rpartition(":")
    if sep and ":" not in host and _port(":" + port):
        value = host
    return value.rstrip(".") or None


def _port(text: str) -> bool:
    return text.startswith(":") and text[1:].isascii() and text[1:].isdigit() and len(text) < 7


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An IP literal (an IPv4-mapped IPv6 one as its IPv4 address), or None."""
    try:
        addr = ipaddress.ip_address(text.split("%")[0])
    except ValueError:
        return None
    mapped = getattr(addr, "ipv4_mapped", None)
    return mapped if mapped is not None else addr


def _same_address(a: str, b: str) -> bool:
    first, second = _address(a), _address(b)
    return first is not None and first == second


def host_allowed(host: str | None, local_address: str, names: frozenset[str]) -> bool:
    """Is ``host`` (the Host header's host part) one of ``names`` or the connection's own
    ``local_address``? A loopback address literal is always allowed."""
    if host is None:
        return False
    if host in names or _same_address(host, local_address):
        return True
    addr = _address(host)
    return addr is not None and addr.is_loopback


def origin_allowed(origin: str, local_address: str, names: frozenset[str]) -> bool:
    """Does a browser's ``Origin`` name this daemon (``null`` and other schemes never do)?"""
    try:
        parts = urlsplit(origin.strip())
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False
    return host_allowed(parts.hostname.lower().rstrip("."), local_address, names)


def refusal(
    host: str | None, origin: str | None, fetch_site: str | None, http10: bool,
    local_address: str, names: frozenset[str],
) -> tuple[int, str] | None:
    """Why a request's headers are refused, as (status, message), or None to serve it: 421 for
    a Host that is not this daemon's (HTTP/1.0 may omit Host), 403 for a browser's
    cross-origin request (``Origin`` naming another site, ``Sec-Fetch-Site: cross-site``)."""
    if host is not None or not http10:
        name = split_host(host) if host is not None else None
        if not host_allowed(name, local_address, names):
            return 421, "this daemon does not serve that Host (see --allowed-host)"
    if origin is not None and not origin_allowed(origin, local_address, names):
        return 403, "cross-origin request refused"
    if fetch_site == "cross-site":
        return 403, "cross-origin request refused"
    return None
