"""HTTP/1.1 message framing for both of ddpmon's servers, written once and sans-IO: bytes in, a
``RequestHead``, ``None`` (incomplete) or an ``HttpError`` carrying the status to answer; a
status and headers in, response-head bytes out.

The agent's /metrics endpoint (a ``selectors`` loop) and the daemon (asyncio) each read and
write their own sockets and hand their buffered bytes to ``parse_request_head``, so the same
bytes get the same answer from both. The bounds are the shared ``Limits``:

- request line over ``max_request_line``: 414; head over ``max_header_bytes`` or more than
  ``max_headers`` fields: 431; a malformed request line, header name or value, a version other
  than HTTP/1.0 or 1.1, or a head cut short by the client's half-close: 400. A client's fault
  is never answered with 5xx (RFC 9112 2.3 leaves 505 optional), so a fuzzer or a confused
  client never shows up as a server error on a dashboard.
- framing by RFC 9112 6.3: a body is framed by ``Content-Length`` only, read as ASCII digits
  (``str.isdigit()`` also takes "²" and "١", which a proxy in front would read differently);
  two framing or credential headers that disagree, or more than one ``Host``, are 400 (which
  one a proxy believed is unknowable: request smuggling). ``Transfer-Encoding`` together with
  ``Content-Length`` is 400. A body longer than ``max_body_bytes`` is 413 (the endpoint takes
  none: any body, chunked too, is 413 there). Chunked bodies are not decoded: a request whose
  final coding is ``chunked`` gets 411 (Length Required: send it again with a
  ``Content-Length``), any other coding 400 (its length cannot be known). Either way the
  answer comes at once and the connection closes; nothing waits for a body it cannot frame.

Missing ``Host`` is not a framing error here: who answers to which name is the host check's
(``hostcheck``, the daemon's), and the endpoint answers any name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .limits import Limits

__all__ = [
    "REASONS",
    "HttpError",
    "RequestHead",
    "declared_length",
    "encode_head",
    "parse_request_head",
    "reason",
    "status_line",
]

REASONS = {
    200: "OK", 201: "Created", 202: "Accepted", 204: "No Content", 400: "Bad Request",
    401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
    408: "Request Timeout", 409: "Conflict", 411: "Length Required", 413: "Content Too Large",
    414: "URI Too Long", 421: "Misdirected Request",
    431: "Request Header Fields Too Large", 500: "Internal Server Error",
    501: "Not Implemented", 503: "Service Unavailable", 505: "HTTP Version Not Supported",
}

_SINGLE = frozenset({"content-length", "transfer-encoding", "authorization"})
"""Header fields a request may carry once (or repeated with the same value)."""
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
"""Bytes a field value may not hold: CR, LF, NUL and the other controls but tab."""
_NOT_VISIBLE = re.compile(rb"[^\x21-\x7e]")
_TOKEN = frozenset(b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


class HttpError(Exception):
    """The request cannot be served; ``code`` is the status to answer with (then close)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@dataclass(slots=True)
class RequestHead:
    """One parsed request head; its body (``content_length`` bytes) follows in the buffer."""

    method: str
    target: bytes
    """The request target as sent (origin form: it starts with ``/``)."""
    version: str
    """``"1.1"`` or ``"1.0"``."""
    headers: dict[str, str]
    """Lowercased names; values latin-1 decoded, surrounding blanks removed (the last of a
    repeated field)."""
    raw_headers: list[tuple[bytes, bytes]]
    """Every field in order, names lowercased (the ASGI form)."""
    keep_alive: bool
    """What the client asked for: HTTP/1.1 unless ``Connection: close``, HTTP/1.0 only with
    ``Connection: keep-alive``."""
    content_length: int
    size: int
    """Bytes of the head, blank line included."""

    @property
    def raw_path(self) -> bytes:
        return self.target.split(b"?", 1)[0].split(b"#", 1)[0]

    @property
    def path(self) -> str:
        return self.raw_path.decode("ascii")

    @property
    def query(self) -> bytes:
        return self.target.partition(b"?")[2].split(b"#", 1)[0]


def parse_request_head(buf: bytearray, lim: Limits) -> RequestHead | None:
    """Take one request head off the front of ``buf``: None while incomplete. The body, if
    any, stays in ``buf``. Empty lines before the request line are dropped (RFC 9112 2.2: some
    clients send a CRLF after a body); they never extend the head's deadline."""
    blank = len(buf) - len(buf.lstrip(b"\r\n"))
    if blank:
        del buf[:blank]
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
    method, target, version = parts
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise HttpError(400)
    if not target.startswith(b"/") or _NOT_VISIBLE.search(target):
        raise HttpError(400)
    if len(lines) - 1 > lim.max_headers:
        raise HttpError(431)
    headers, raw = _fields(lines[1:])
    length = body_length(headers, lim)
    connection = headers.get("connection", "").lower()
    keep = ("close" not in connection) if version == b"HTTP/1.1" else "keep-alive" in connection
    return RequestHead(method.decode("ascii"), target, version[5:].decode("ascii"), headers,
                       raw, keep, length, end + sep)


def _fields(lines: list[bytes]) -> tuple[dict[str, str], list[tuple[bytes, bytes]]]:
    headers: dict[str, str] = {}
    raw: list[tuple[bytes, bytes]] = []
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not name or not set(name) <= _TOKEN:
            raise HttpError(400)  # obs-fold (a leading blank) included: RFC 9112 5.2
        value = value.strip(b" \t")
        if _CONTROL.search(value):
            raise HttpError(400)  # RFC 9110 5.5
        key = name.decode("ascii").lower()
        text = value.decode("latin-1")  # latin-1 decodes any byte
        if key == "host" and key in headers:
            raise HttpError(400)  # RFC 9112 3.2: more than one Host line
        if key in _SINGLE and key in headers and headers[key] != text:
            raise HttpError(400)  # two framing or credential values: which did a proxy read?
        headers[key] = text
        raw.append((key.encode("ascii"), value))
    return headers, raw


def body_length(headers: dict[str, str], lim: Limits) -> int:
    """The body length a head declares, or the ``HttpError`` that refuses its framing."""
    coding = headers.get("transfer-encoding")
    if coding is not None:
        if "content-length" in headers:
            raise HttpError(400)  # both: a smuggling attempt or a broken proxy (RFC 9112 6.3)
        if lim.max_body_bytes == 0:
            raise HttpError(413)
        final = coding.rsplit(",", 1)[-1].strip().lower()
        raise HttpError(411 if final == "chunked" else 400)
    length = declared_length(headers.get("content-length", "0"))
    if length is None:
        raise HttpError(400)
    if length > lim.max_body_bytes:
        raise HttpError(413)
    return length


def encode_head(status: int, headers: list[tuple[str, str]]) -> bytes:
    """A response head: the status line, ``headers`` in order, the blank line. ValueError when
    a name or value holds a line break or NUL (it would split the response)."""
    lines = [status_line(status)]
    for name, value in headers:
        line = f"{name}: {value}"
        if any(ch in line for ch in "\r\n\x00"):
            raise ValueError(f"header {name!r} would split the response")
        lines.append(line)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


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


def _header_end(buf: bytearray) -> tuple[int, int]:
    """Index of the blank line ending the headers and its length, or (-1, 0)."""
    crlf = buf.find(b"\r\n\r\n")
    lf = buf.find(b"\n\n")
    if crlf >= 0 and (lf < 0 or crlf <= lf):
        return crlf, 4
    if lf >= 0:
        return lf, 2
    return -1, 0
