"""The daemon front's ASGI pieces: the scope of a parsed request (``ddpmon.web.framing``), the
ASGI call (one buffered request in, one buffered response out) and JSON error bodies. Kept
apart from the connection handling in ``server.py`` so each stays small."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ..web.framing import RequestHead

Response = tuple[int, list[tuple[bytes, bytes]], bytes]


def asgi_scope(
    head: RequestHead,
    path: str,
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
        "http_version": head.version,
        "method": head.method,
        "scheme": "https" if tls else "http",
        "path": path,
        "raw_path": head.raw_path,
        "query_string": head.query,
        "root_path": "",
        "headers": head.raw_headers,
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


def json_error(
    status: int, message: str, *, retry: bool = False, extra: dict[str, Any] | None = None
) -> Response:
    headers = [(b"content-type", b"application/json")]
    if retry:
        headers.append((b"retry-after", b"1"))
    doc = {"error": message, "status": status, **(extra or {})}
    return status, headers, json.dumps(doc).encode()
