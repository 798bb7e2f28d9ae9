"""HTTP/1.1 message framing rules shared by both servers: status lines and reasons, and how a
declared body length is read.

The endpoint parses its bodiless requests itself (``ddpmon.export.http11``); the daemon lets
h11 frame requests that carry bodies. Both answer with the same status lines and read
``Content-Length`` by the same rule: ASCII digits only, because ``str.isdigit()`` also takes
"²" and "١", which a proxy in front would read differently (request smuggling).
"""

from __future__ import annotations

__all__ = ["REASONS", "declared_length", "reason", "status_line"]

REASONS = {
    200: "OK", 201: "Created", 202: "Accepted", 204: "No Content", 400: "Bad Request",
    401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
    408: "Request Timeout", 409: "Conflict", 413: "Content Too Large", 414: "URI Too Long",
    421: "Misdirected Request",
    431: "Request Header Fields Too Large", 500: "Internal Server Error",
    501: "Not Implemented", 503: "Service Unavailable", 505: "HTTP Version Not Supported",
}


def reason(status: int) -> str:
    return REASONS.get(status, "Status")


def status_line(status: int) -> str:
    return f"HTTP/1.1 {status} {reason(status)}"


def declared_length(value: str) -> int | None:
    """A ``Content-Length`` value as a number, or None when it is not plain ASCII digits."""
    value = value.strip()
    if not (value.isascii() and value.isdigit()):
        return None
    return int(value)
