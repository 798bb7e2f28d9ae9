"""The daemon's HTTP front: a small asyncio HTTP/1.1 server that runs the FastAPI app directly.

Why not uvicorn: it has no deadline for reading a request head, and idle connections count
against ``limit_concurrency``, so a few dozen silent sockets answer every Prometheus scrape
with 503. Here each connection gets one deadline from accept that covers the TLS handshake and
the request head (bytes trickling in do not extend it); at the connection cap a newcomer
evicts the oldest connection that has not sent a full request, so idle clients can never lock
scrapes out; only requests being handled count against ``max_in_flight``. Bodies are framed
by ``Content-Length`` only (chunked: 411), bounded, and read under their own deadline;
responses are buffered (the app's answers are small) and written under a write deadline.

Request parsing and framing, the bounds, deadlines, eviction rule, basic-auth gate, status
lines and Host/Origin checks are the shared HTTP core (``ddpmon.web``), which the agent's
/metrics endpoint uses too: this module only reads and writes the sockets.

With a web config (exporter-toolkit format, ``ddpmon.web.config``) the listener serves
TLS (optionally mTLS) and basic auth guards every path, except that job routes also accept the
daemon's bearer token instead (job mutations always need the token; the app checks it).

Ranks register on a second listener, the agent socket (``agent_socket``): a Unix socket that
serves only rank registration and /healthz, with the caller's PID from ``SO_PEERCRED`` in the
request's scope. Registration over TCP is refused before its body is read, with the socket's
path in the answer (the agent's client follows it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from ..web import hostcheck
from ..web.agent_socket import Peer, listen, peer_credentials
from ..web.config import WebConfig
from ..web.framing import HttpError, RequestHead, encode_head, parse_request_head, reason
from ..web.limits import Limits, count_status, oldest_idle, server_stats
from .asgi import Response, asgi_scope, call_app, json_error
from .request_auth import RequestAuth

log = logging.getLogger("ddpmon.daemon.server")

__all__ = ["DaemonLimits", "DaemonServer"]


@dataclass(kw_only=True, slots=True)
class DaemonLimits(Limits):
    """The shared bounds (``ddpmon.web.limits``) with the daemon's defaults, plus those of
    requests that carry bodies and run the app."""

    max_connections: int = 128
    idle_timeout: float = 5.0
    """Keep-alive: seconds from the end of a response to the next complete request head."""
    max_header_bytes: int = 16 * 1024
    max_requests_per_connection: int = 1000
    max_request_line: int = 8 * 1024
    max_in_flight: int = 32
    """Requests being handled at once; beyond, 503 (idle connections do not count)."""
    max_body_bytes: int = 1024 * 1024


@dataclass(eq=False, slots=True)
class _Conn:
    accepted: float
    task: asyncio.Task[Any] | None = None
    transport: asyncio.BaseTransport | None = None
    busy: bool = False
    """A full request is in; the connection may not be evicted."""
    tls: bool = False
    peer: Peer | None = None
    """The calling process, on the agent socket (None on TCP)."""
    stats: dict[str, int] = field(default_factory=dict)
    unread: int = 0
    """Body bytes of the current request not yet read."""


class _Close(Exception):
    """End this connection without a response (deadline, eviction, client gone)."""


class DaemonServer:
    """Serve an ASGI ``app`` on ``bind:port``; ``run()`` blocks until SIGTERM/SIGINT."""

    def __init__(
        self,
        app: Callable[..., Any],
        *,
        bind: str,
        port: int,
        token: str,
        web_config: WebConfig | None = None,
        limits: DaemonLimits | None = None,
        agent_socket: Path | None = None,
        host_names: frozenset[str] | None = None,
    ) -> None:
        self.app = app
        self.bind, self.port = bind, port
        self.web = web_config
        self.limits = limits or DaemonLimits()
        self.names = host_names if host_names is not None else hostcheck.host_names(bind, None)
        """The Host names this daemon answers to besides the connection's own address
        (``hostcheck``: DNS rebinding and cross-origin requests are refused)."""
        self.agent_socket = agent_socket
        """The Unix socket on which ranks register (``agent_socket``); None serves none."""
        self._conns: list[_Conn] = []
        self._in_flight = 0
        self._auth = RequestAuth(web_config, token.encode(), self.limits.max_auth_pending)
        self._servers: list[asyncio.base_events.Server] = []
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stats: dict[str, int] = server_stats("rejected_busy")

    @property
    def tls(self) -> bool:
        return self.web is not None and self.web.ssl_context is not None

    # lifecycle ------------------------------------------------------------------------------

    def run(self, on_ready: Callable[[], None] | None = None) -> None:
        asyncio.run(self.serve(on_ready))

    async def serve(self, on_ready: Callable[[], None] | None = None) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._stop.set)
        self._servers.append(
            await asyncio.start_server(
                lambda r, w: self._accept(r, w, agent=False),
                self.bind, self.port, backlog=256, reuse_address=True,
            )
        )
        if self.port == 0:
            self.port = int(self._servers[0].sockets[0].getsockname()[1])
        if self.agent_socket is not None:
            self._servers.append(
                await asyncio.start_unix_server(
                    lambda r, w: self._accept(r, w, agent=True), sock=listen(self.agent_socket)
                )
            )
        if on_ready is not None:
            on_ready()
        await self._stop.wait()
        for server in self._servers:
            server.close()
        for conn in list(self._conns):
            self._drop(conn)
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2.0)
        if self.agent_socket is not None:
            with contextlib.suppress(OSError):
                self.agent_socket.unlink()

    def stop(self) -> None:
        """Stop serving; callable from any thread."""
        if self._stop is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    # connections ----------------------------------------------------------------------------

    def _drop(self, conn: _Conn) -> None:
        if conn.transport is not None:
            conn.transport.abort()
        if conn.task is not None and conn.task is not asyncio.current_task():
            conn.task.cancel()

    def _admit(self, conn: _Conn) -> bool:
        if len(self._conns) >= self.limits.max_connections:
            victim = oldest_idle(
                self._conns, idle=lambda c: not c.busy, accepted=lambda c: c.accepted
            )
            if victim is None:
                self.stats["rejected_busy"] += 1
                return False
            self._conns.remove(victim)
            self.stats["evicted"] += 1
            self._drop(victim)
        self._conns.append(conn)
        return True

    async def _accept(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, agent: bool
    ) -> None:
        conn = _Conn(accepted=time.monotonic(), task=asyncio.current_task(),
                     transport=writer.transport)
        self.stats["accepted"] += 1
        if agent:
            try:
                conn.peer = peer_credentials(writer.get_extra_info("socket"))
            except (OSError, AttributeError, TypeError):
                writer.transport.abort()
                return
        if not self._admit(conn):
            writer.transport.abort()
            return
        deadline = self.limits.head_deadline(conn.accepted)
        graceful = False
        try:
            if self.tls and not agent:
                assert self.web is not None and self.web.ssl_context is not None
                try:
                    async with asyncio.timeout_at(self._loop_time(deadline)):
                        await writer.start_tls(self.web.ssl_context)
                except (TimeoutError, ssl.SSLError, ConnectionError, OSError):
                    self.stats["tls_failed"] += 1
                    return
                conn.transport, conn.tls = writer.transport, True
            await self._serve_connection(conn, reader, writer, deadline)
            graceful = True
        except (_Close, ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass
        except Exception:  # a bug here must cost one connection, never the daemon
            self.stats["errors"] += 1
            log.exception("ddpmon daemon: connection handler failed")
        finally:
            if conn in self._conns:
                self._conns.remove(conn)
        if graceful:  # let buffered response bytes (and TLS close_notify) go out first
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), self.limits.write_timeout)
        if conn.transport is not None:
            conn.transport.abort()

    @staticmethod
    def _loop_time(monotonic_deadline: float) -> float:
        loop = asyncio.get_running_loop()
        return loop.time() + (monotonic_deadline - time.monotonic())

    async def _serve_connection(
        self,
        conn: _Conn,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        deadline: float,
    ) -> None:
        buf = bytearray()
        for served in range(self.limits.max_requests_per_connection):
            try:
                head = await self._read_head(reader, buf, deadline, idle=served > 0 and not buf)
            except HttpError as exc:  # the shared parser's answer, the endpoint's too
                await self._raw_error(writer, exc.code)
                return
            if head is None:
                return  # the client went away between requests
            self.stats["requests"] += 1
            conn.unread = head.content_length
            status, headers, body = await self._handle(head, buf, reader, writer, conn)
            keep = (
                head.keep_alive
                and served + 1 < self.limits.max_requests_per_connection
                and (status < 400 or status in (401, 404, 409))
            )
            await self._respond(writer, head, status, headers, body, keep)
            if conn.unread:
                # Answered before the body was read (401, 404): read and drop it (bounded, and
                # evictable meanwhile) so closing with unread data does not reset the answer.
                try:
                    await self._read_body(reader, buf, conn)
                except _Close:
                    return
            if not keep:
                return
            deadline = self.limits.next_head_deadline(time.monotonic(), bool(buf))

    async def _read(self, reader: asyncio.StreamReader, deadline: float) -> bytes:
        """The next bytes from the client; ``_Close`` at ``deadline``."""
        try:
            async with asyncio.timeout_at(self._loop_time(deadline)):
                return await reader.read(65536)
        except TimeoutError:
            self.stats["timed_out"] += 1
            raise _Close from None

    async def _read_head(
        self, reader: asyncio.StreamReader, buf: bytearray, deadline: float, *, idle: bool
    ) -> RequestHead | None:
        """The next request head from ``buf`` and the socket (``framing.parse_request_head``),
        None when the client closed between requests. ``idle``: a kept-alive connection
        waiting for a new request, whose head deadline starts with its first byte."""
        while True:
            head = parse_request_head(buf, self.limits)
            if head is not None:
                return head
            data = await self._read(reader, deadline)
            if not data:
                if buf.strip():
                    raise HttpError(400)  # the client half-closed inside a request head
                return None
            if idle:
                deadline, idle = self.limits.head_deadline(time.monotonic()), False
            buf += data

    async def _read_body(
        self, reader: asyncio.StreamReader, buf: bytearray, conn: _Conn
    ) -> bytes:
        """The ``conn.unread`` body bytes (bounded by the parser), under the body deadline."""
        deadline = time.monotonic() + self.limits.body_timeout
        while len(buf) < conn.unread:
            data = await self._read(reader, deadline)
            if not data:
                raise _Close
            buf += data
        body = bytes(buf[: conn.unread])
        del buf[: conn.unread]
        conn.unread = 0
        return body

    async def _raw_error(self, writer: asyncio.StreamWriter, status: int) -> None:
        body = f'{{"error": "{reason(status).lower()}", "status": {status}}}'.encode()
        head = encode_head(status, [("content-type", "application/json"),
                                    ("content-length", str(len(body))), ("connection", "close")])
        writer.write(head + body)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.drain(), self.limits.write_timeout)
        count_status(self.stats, status)

    # requests -------------------------------------------------------------------------------

    async def _handle(
        self,
        head: RequestHead,
        buf: bytearray,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        conn: _Conn,
    ) -> Response:
        try:
            path = unquote(head.path, errors="strict")
        except (UnicodeDecodeError, UnicodeEncodeError):
            return json_error(400, "request path is not valid")
        agent = conn.peer is not None
        if not agent:  # a browser cannot reach a Unix socket: no rebinding there
            local = str((writer.get_extra_info("sockname") or ("",))[0])
            refused = hostcheck.refusal(
                head.headers.get("host"), head.headers.get("origin"),
                head.headers.get("sec-fetch-site"), head.version == "1.0", local, self.names,
            )
            if refused is not None:
                return json_error(*refused)
        registration = path == "/api/v1/ranks" or path.startswith("/api/v1/ranks/")
        if agent and not (registration or path == "/healthz"):
            return json_error(404, "the agent socket serves rank registration only")
        if registration and not agent:
            # before any body is read: over TCP nobody can prove which process is calling
            return json_error(
                403, "ranks register through the daemon's agent socket",
                extra={"agent_socket": str(self.agent_socket) if self.agent_socket else None},
            )
        if not agent and not registration:
            denied = await self._auth.refusal(path, head.headers.get("authorization"))
            if denied is not None:
                return denied
        # a connection reading a body stays evictable (conn.busy is False until here)
        body = await self._read_body(reader, buf, conn)
        if self._in_flight >= self.limits.max_in_flight:
            self.stats["rejected_busy"] += 1
            return json_error(503, "too many requests in flight", retry=True)
        self._in_flight += 1
        conn.busy = True
        try:
            scope = asgi_scope(head, path, writer, conn.tls, conn.peer)
            try:
                return await call_app(self.app, scope, body)
            except Exception:
                self.stats["errors"] += 1
                log.exception("ddpmon daemon: request %s %s failed", scope["method"], path)
                return json_error(500, "internal error")
        finally:
            self._in_flight -= 1
            conn.busy = False

    async def _respond(
        self,
        writer: asyncio.StreamWriter,
        head: RequestHead,
        status: int,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        keep: bool,
    ) -> None:
        drop = {b"content-length", b"transfer-encoding", b"connection"}
        out = [(k.decode("latin-1"), v.decode("latin-1"))
               for k, v in headers if k.lower() not in drop]
        if self.web is not None:
            out += list(self.web.headers.items())
        out.append(("content-length", str(len(body))))
        if not keep:
            out.append(("connection", "close"))
        elif head.version == "1.0":
            out.append(("connection", "keep-alive"))
        count_status(self.stats, status)
        try:
            data = encode_head(status, out)
        except ValueError:  # the app put a line break in a header: send nothing split
            self.stats["errors"] += 1
            raise _Close from None
        writer.write(data + body if head.method != "HEAD" else data)
        try:
            await asyncio.wait_for(writer.drain(), self.limits.write_timeout)
        except TimeoutError:
            self.stats["timed_out"] += 1
            raise _Close from None
