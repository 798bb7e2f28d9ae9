"""The daemon's HTTP front: a small asyncio HTTP/1.1 server that runs the FastAPI app directly.

Why not uvicorn: it has no deadline for reading a request head, and idle connections count
against ``limit_concurrency``, so a few dozen silent sockets answer every Prometheus scrape
with 503. Here each connection gets one deadline from accept that covers the TLS handshake and
the request head (bytes trickling in do not extend it); at the connection cap a newcomer
evicts the oldest connection that has not sent a full request, so idle clients can never lock
scrapes out; only requests being handled count against ``max_in_flight``. Parsing is h11's
(strict, bounded head size); bodies are bounded and read under their own deadline; responses
are buffered (the app's answers are small) and written under a write deadline.

The bounds, deadlines, eviction rule, basic-auth gate, status lines and Host/Origin checks are
the shared HTTP core (``ddpmon.web``), which the agent's /metrics endpoint uses too.

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

import h11

from ..web import hostcheck
from ..web.agent_socket import Peer, listen, peer_credentials
from ..web.config import WebConfig
from ..web.framing import reason, status_line
from ..web.limits import Limits, count_status, oldest_idle, server_stats
from .asgi import asgi_scope, call_app, content_length, head_size, header, json_error
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
    max_in_flight: int = 32
    """Requests being handled at once; beyond, 503 (idle connections do not count)."""
    body_timeout: float = 10.0
    """Seconds to receive a request body once its head is in."""
    max_body_bytes: int = 1024 * 1024
    """Request body (413 beyond)."""


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


class _TooLarge(Exception):
    pass


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
        h = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_header_bytes)
        for _ in range(self.limits.max_requests_per_connection):
            try:
                event = await self._next(h, reader, deadline)
            except h11.RemoteProtocolError as exc:
                # A malformed request is the client's fault: 4xx, never 5xx (h11 hints 501 for
                # an unknown Transfer-Encoding and 505 for odd versions).
                hint = exc.error_status_hint
                status = hint if hint in (413, 414, 431) else 400
                await self._raw_error(writer, status, deadline)
                return
            if not isinstance(event, h11.Request):
                return  # ConnectionClosed: the client went away between requests
            if head_size(event) > self.limits.max_header_bytes:
                # h11 bounds a head only while it is incomplete; one that arrives whole in a
                # single read is measured here.
                await self._raw_error(writer, 431, deadline)
                return
            self.stats["requests"] += 1
            status, headers, body = await self._handle(h, event, reader, writer, conn)
            await self._respond(h, writer, event, status, headers, body)
            if h.their_state is h11.SEND_BODY and status != 413:
                # Answered before the body was read (401, 404): read and drop it (bounded, and
                # evictable meanwhile) so closing with unread data does not reset the answer.
                with contextlib.suppress(_Close, _TooLarge):
                    await self._body(h, reader)
            if h.our_state is not h11.DONE or h.their_state is not h11.DONE:
                return
            h.start_next_cycle()
            deadline = self.limits.idle_deadline(time.monotonic())

    async def _next(self, h: h11.Connection, reader: asyncio.StreamReader, deadline: float) -> Any:
        try:
            async with asyncio.timeout_at(self._loop_time(deadline)):
                while True:
                    event = h.next_event()
                    if event is not h11.NEED_DATA:
                        return event
                    h.receive_data(await reader.read(65536))
        except TimeoutError:
            self.stats["timed_out"] += 1
            raise _Close from None

    async def _raw_error(self, writer: asyncio.StreamWriter, status: int, deadline: float) -> None:
        body = f'{{"error": "{reason(status).lower()}", "status": {status}}}'.encode()
        head = (
            f"{status_line(status)}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        ).encode()
        writer.write(head + body)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.drain(), self.limits.write_timeout)
        count_status(self.stats, status)

    # requests -------------------------------------------------------------------------------

    async def _handle(
        self,
        h: h11.Connection,
        req: h11.Request,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        conn: _Conn,
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        headers = [(k.lower(), v) for k, v in req.headers]
        target = req.target
        raw_path, _, query = target.partition(b"?")
        if not raw_path.startswith(b"/"):
            return json_error(400, "request target must be an absolute path")
        try:
            path = unquote(raw_path.decode("ascii"), errors="strict")
        except (UnicodeDecodeError, UnicodeEncodeError):
            return json_error(400, "request path is not valid")
        chunked = header(headers, b"transfer-encoding") is not None
        if chunked and content_length(headers) is not None:
            # Ambiguous framing: a proxy in front may have read the body by the other header, so
            # the next bytes may be a smuggled request; answer and close (RFC 9112 6.3).
            return json_error(400, "both Content-Length and Transfer-Encoding")
        agent = conn.peer is not None
        if not agent:  # a browser cannot reach a Unix socket: no rebinding there
            refused = self._check_origin(req, headers, writer)
            if refused is not None:
                return json_error(*refused)
        length = content_length(headers)
        if length is not None and length > self.limits.max_body_bytes:
            return json_error(413, f"request body over {self.limits.max_body_bytes} bytes")
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
            denied = await self._auth.refusal(path, headers)
            if denied is not None:
                return denied
        try:  # a connection reading a body stays evictable (conn.busy is False until here)
            body = await self._body(h, reader)
        except _TooLarge:
            return json_error(413, f"request body over {self.limits.max_body_bytes} bytes")
        if self._in_flight >= self.limits.max_in_flight:
            self.stats["rejected_busy"] += 1
            return json_error(503, "too many requests in flight", retry=True)
        self._in_flight += 1
        conn.busy = True
        try:
            scope = asgi_scope(req, path, raw_path, query, headers, writer, conn.tls, conn.peer)
            try:
                return await call_app(self.app, scope, body)
            except Exception:
                self.stats["errors"] += 1
                log.exception("ddpmon daemon: request %s %s failed", scope["method"], path)
                return json_error(500, "internal error")
        finally:
            self._in_flight -= 1
            conn.busy = False

    def _check_origin(
        self, req: h11.Request, headers: list[tuple[bytes, bytes]], writer: asyncio.StreamWriter
    ) -> tuple[int, str] | None:
        """DNS rebinding and cross-origin requests (``hostcheck.refusal``)."""

        def text(name: bytes) -> str | None:
            value = header(headers, name)
            return value.decode("latin-1") if value is not None else None

        local = str((writer.get_extra_info("sockname") or ("",))[0])
        return hostcheck.refusal(text(b"host"), text(b"origin"), text(b"sec-fetch-site"),
                                 req.http_version == b"1.0", local, self.names)

    async def _body(self, h: h11.Connection, reader: asyncio.StreamReader) -> bytes:
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.limits.body_timeout
        while True:
            try:
                event = await self._next(h, reader, deadline)
            except h11.RemoteProtocolError:
                raise _Close from None
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > self.limits.max_body_bytes:
                    raise _TooLarge
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(chunks)
            else:
                raise _Close

    async def _respond(
        self,
        h: h11.Connection,
        writer: asyncio.StreamWriter,
        req: h11.Request,
        status: int,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> None:
        drop = {b"content-length", b"transfer-encoding", b"connection"}
        out = [(k, v) for k, v in headers if k.lower() not in drop]
        if self.web is not None:
            out += [(k.encode(), v.encode()) for k, v in self.web.headers.items()]
        out.append((b"content-length", str(len(body)).encode()))
        if status >= 400 and status not in (401, 404, 409):
            out.append((b"connection", b"close"))
        count_status(self.stats, status)
        try:
            data = h.send(h11.Response(status_code=status, headers=out, reason=reason(status)))
            if req.method != b"HEAD" and body:
                data += h.send(h11.Data(data=body))
            data += h.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            raise _Close from None
        writer.write(data)
        try:
            await asyncio.wait_for(writer.drain(), self.limits.write_timeout)
        except TimeoutError:
            self.stats["timed_out"] += 1
            raise _Close from None
