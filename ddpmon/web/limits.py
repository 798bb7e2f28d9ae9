"""Bounds and deadlines that keep a slow or hostile client from holding a ddpmon server.

One rule for both servers: a connection gets one deadline from accept that covers the TLS
handshake and the request head (bytes trickling in do not extend it); after a response, the
next request head is due within the keep-alive idle time (or the request time when it is
already buffered); a response must be read within the write time. At the connection cap a
newcomer evicts the oldest connection that has no request in progress, so idle sockets can
never lock a scraper out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Limits", "count_status", "oldest_idle", "server_stats"]

T = TypeVar("T")


@dataclass(kw_only=True, slots=True)
class Limits:
    """The bounds every ddpmon server enforces (defaults: the agent's /metrics endpoint)."""

    max_connections: int = 64
    """Open connections; at the cap a newcomer evicts the oldest one without a full request."""
    request_timeout: float = 5.0
    """Seconds from accept (or from the end of the last response) to complete request headers,
    TLS handshake included; bytes trickling in do not extend it."""
    write_timeout: float = 10.0
    """Seconds a client may take to read a response."""
    idle_timeout: float = 60.0
    """Keep-alive: seconds an idle connection that has completed a request may stay open."""
    max_request_line: int = 2048
    """Bytes in the request line (414 beyond)."""
    max_header_bytes: int = 8192
    """Bytes of request line plus headers (431 beyond)."""
    max_headers: int = 64
    """Header fields (431 beyond)."""
    max_auth_pending: int = 16
    """Uncached basic-auth checks queued for bcrypt; beyond, 503 (cached credentials pass)."""
    max_requests_per_connection: int = 10_000
    max_body_bytes: int = 0
    """Request body (413 beyond). The endpoint serves GET and HEAD only and takes none."""
    body_timeout: float = 10.0
    """Seconds to receive a request body once its head is in."""

    def head_deadline(self, since: float) -> float:
        """When a request head begun at ``since`` (accept, or a new request on a kept-alive
        connection) must be complete."""
        return since + self.request_timeout

    def next_head_deadline(self, now: float, buffered: bool) -> float:
        """After a response at ``now``: the deadline for the next request head, which is the
        request time when its first bytes are already buffered, else the keep-alive idle time.
        When the first byte of a new request arrives on an idle connection, the head deadline
        starts again from that moment (``head_deadline``)."""
        return self.head_deadline(now) if buffered else self.idle_deadline(now)

    def idle_deadline(self, since: float) -> float:
        """When a kept-alive connection that finished a response at ``since`` must have sent
        its next request head."""
        return since + self.idle_timeout

    def write_deadline(self, since: float) -> float:
        """When a response started at ``since`` must have been read by the client."""
        return since + self.write_timeout


def oldest_idle(
    conns: Iterable[T], *, idle: Callable[[T], bool], accepted: Callable[[T], float]
) -> T | None:
    """The connection to evict at the cap: the oldest one without a request in progress, or
    None when every connection is busy (then the newcomer is refused)."""
    victims = [c for c in conns if idle(c)]
    return min(victims, key=accepted) if victims else None


def server_stats(*extra: str) -> dict[str, int]:
    """A server's counters (for tests and debugging); ``status_<code>`` keys are added as
    responses are counted (``count_status``)."""
    names = ("accepted", "evicted", "timed_out", "tls_failed", "requests", *extra, "errors")
    return dict.fromkeys(names, 0)


def count_status(stats: dict[str, int], code: int) -> None:
    key = f"status_{code}"
    stats[key] = stats.get(key, 0) + 1
