"""HTTP/1.1 request heads and response heads for ddpmon's endpoints, strictly bounded.

Parsing is separate from the event loop (``connections.py``) so that it can be reasoned about
and tested as a pure function: bytes in, a ``Request``, ``None`` (incomplete) or an ``HttpError``
carrying the status to answer. Anything not needed to serve a read-only ``/metrics`` is refused:
request bodies, transfer codings, over-long lines and headers, odd methods and targets. The
bounds are the shared ``ddpmon.web.limits.Limits``; status lines and the length rule come from
``ddpmon.web.framing``, which the daemon uses too.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpmon.web.framing import declared_length, reason, status_line
from ddpmon.web.limits import Limits

__all__ = ["HttpError", "Request", "parse_request_head", "response_head"]

_SINGLE = frozenset({"content-length", "transfer-encoding", "host", "authorization"})
"""Header fields a request may carry once (or repeated with the same value)."""
_TOKEN = frozenset(b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


class HttpError(Exception):
    """The request cannot be served; ``code`` is the status to answer with (then close)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@dataclass(slots=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]
    keep_alive: bool
    """What the client asked for: HTTP/1.1 unless ``Connection: close``, HTTP/1.0 only with
    ``Connection: keep-alive``."""


def parse_request_head(buf: bytearray, lim: Limits) -> Request | None:
    """Take one request head off the front of ``buf``: None while incomplete."""
    end, sep = _header_end(buf)
    line_end = buf.find(b"\n")
    if (line_end < 0 and len(buf) > lim.max_request_line) or line_end > lim.max_request_line:
        raise HttpError(414)
    if end < 0:
        if len(buf) > lim.max_header_bytes:
            raise HttpError(431)
        return None
    if end + sep > lim.max_header_bytes:
        raise HttpError(431)
    head = bytes(buf[:end])
    del buf[: end + sep]
    lines = head.replace(b"\r\n", b"\n").split(b"\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[0] or not set(parts[0]) <= _TOKEN:
        raise HttpError(400)
    method_b, target, version = parts
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise HttpError(505 if version.startswith(b"HTTP/") and len(version) == 8 else 400)
    if not target.startswith(b"/") or any(b < 0x21 or b > 0x7E for b in target):
        raise HttpError(400)
    if len(lines) - 1 > lim.max_headers:
        raise HttpError(431)
    headers: dict[str, str] = {}
    for raw in lines[1:]:
        name, colon, value = raw.partition(b":")
        if not colon or not name or not set(name) <= _TOKEN:
            raise HttpError(400)
        text = value.strip(b" \t").decode("latin-1")  # latin-1 decodes any byte
        if any(ch in text for ch in "\r\n\x00"):
            raise HttpError(400)
        key = name.decode("ascii").lower()
        if key in _SINGLE and key in headers and headers[key] != text:
            # Two framing or credential headers that disagree: which one a proxy in front
            # believed is unknowable (request smuggling), so neither is (RFC 9112 6.3).
            raise HttpError(400)
        headers[key] = text
    if "transfer-encoding" in headers:
        raise HttpError(413)
    length = declared_length(headers.get("content-length", "0"))
    if length is None:
        raise HttpError(400)
    if length > 0:
        raise HttpError(413)
    connection = headers.get("connection", "").lower()
    keep = ("close" not in connection) if version == b"HTTP/1.1" else "keep-alive" in connection
    path = target.split(b"?", 1)[0].split(b"#", 1)[0].decode("ascii")
    return Request(method_b.decode("ascii"), path, headers, keep)


def response_head(
    code: int,
    date: str,
    ctype: str,
    keep: bool,
    body: bytes | None,
    extra: dict[str, str],
) -> tuple[bytes, bytes]:
    """(head, body) of a response; an error without a body gets ``"<code> <reason>"``."""
    if body is None:
        body = f"{code} {reason(code)}\n".encode()
    lines = [
        status_line(code),
        f"Date: {date}",
        f"Content-Type: {ctype}",
        f"Content-Length: {len(body)}",
        "Connection: keep-alive" if keep else "Connection: close",
    ]
    if code == 401:
        lines.append('WWW-Authenticate: Basic realm="ddpmon", charset="UTF-8"')
    lines.extend(f"{name}: {value}" for name, value in extra.items())
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"), body


def _header_end(buf: bytearray) -> tuple[int, int]:
    """Index of the blank line ending the headers and its length, or (-1, 0)."""
    crlf = buf.find(b"\r\n\r\n")
    lf = buf.find(b"\n\n")
    if crlf >= 0 and (lf < 0 or crlf <= lf):
        return crlf, 4
    if lf >= 0:
        return lf, 2
    return -1, 0
