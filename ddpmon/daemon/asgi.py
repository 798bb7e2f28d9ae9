"""The daemon front's HTTP pieces: the ASGI call (one buffered request in, one buffered
response out), JSON error bodies, and header helpers (status lines and the length rule are the
shared ``ddpmon.web.framing``). Kept apart from the connection handling
in ``server.py`` so each stays small."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11

from ..web.framing import declared_length

Response = tuple[int, list[tuple[bytes, bytes]], bytes]


def asgi_scope(
    req: h11.Request,
    path: str,
    raw_path: bytes,
    query: bytes,
    headers: list[tuple[bytes, bytes]],
    writer: asyncio.StreamWriter,
    tls: bool,
    caller: Any = None,
) -> dict[str, Any]:
    """The ASGI HTTP scope; ``client`` and ``server`` are the socket's real addresses. On the
    agent socket (a Unix socket, no addresses) ``caller`` is the calling process
    (``agent_socket.Peer``), under ``extensions["ddpmon.peer"]``."""
    if caller is not None:
        client, server = None, None
    else:
        peer = writer.get_extra_info("peername") or ("", 0)
        sock = writer.get_extra_info("sockname") or ("", 0)
        client, server = (str(peer[0]), int(peer[1])), (str(sock[0]), int(sock[1]))
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": req.http_version.decode("ascii", "replace"),
        "method": req.method.decode("ascii", "replace"),
        "scheme": "https" if tls else "http",
        "path": path,
        "raw_path": raw_path,
        "query_string": query,
        "root_path": "",
        "headers": headers,
        "client": client,
        "server": server,
        "extensions": {"ddpmon.peer": caller},
    }


async def call_app(app: Any, scope: dict[str, Any], body: bytes) -> Response:
    """Run ``app`` on one request whose body is already read; collect the whole response."""
    sent = False
    done = asyncio.Event()
    response: dict[str, Any] = {"status": 500, "headers": [], "body": []}

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            response["status"] = int(message["status"])
            response["headers"] = list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            response["body"].append(bytes(message.get("body", b"")))

    try:
        await app(scope, receive, send)
    finally:
        done.set()
    return response["status"], response["headers"], b"".join(response["body"])


def head_size(req: h11.Request) -> int:
    return len(req.method) + len(req.target) + 12 + sum(
        len(k) + len(v) + 4 for k, v in req.headers.raw_items()
    )


def header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for k, v in headers:
        if k == name:
            return v
    return None


def content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The declared body length (h11 has already refused a malformed or conflicting one)."""
    value = header(headers, b"content-length")
    return declared_length(value.decode("latin-1")) if value is not None else None


def json_error(
    status: int, message: str, *, retry: bool = False, extra: dict[str, Any] | None = None
) -> Response:
    headers = [(b"content-type", b"application/json")]
    if retry:
        headers.append((b"retry-after", b"1"))
    doc = {"error": message, "status": status, **(extra or {})}
    return status, headers, json.dumps(doc).encode()
