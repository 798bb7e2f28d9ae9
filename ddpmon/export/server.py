"""The per-rank HTTP endpoint: serves ``render()`` on /metrics and nothing else.

It lives inside a training process, so a broken or hostile client must never slow or crash
training. One thread runs the event loop of ``connections.py``, which owns sockets, TLS
handshakes, deadlines, the connection cap with eviction and graceful close. This module is the
HTTP layer on top: it binds the port, turns buffered bytes into requests with the shared parser
(``ddpmon.web.framing``, which enforces the size limits and refuses any body), serves only
GET/HEAD of ``/metrics`` and ``/``, adds the web config's headers, and applies basic auth
through the shared gate (``ddpmon.web.auth``). bcrypt checks (tens of ms, GIL released) run on
one worker thread so the loop keeps serving; credentials that verified before pass at once.

Interface used by the agent and the daemon: ``MetricsServer(render, bind=..., port=...,
web_config=None)``, ``.start()`` (``WebConfigError``, ``PortInUseError``), ``.port``,
``.close()``, ``.deliveries`` (which answers reached a store's scraper, for linger).
"""

from __future__ import annotations

import errno
import functools
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import formatdate

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ddpmon.export.connections import Conn, ConnectionLoop
from ddpmon.export.delivery import Deliveries, is_store_scraper
from ddpmon.web.auth import AuthGate, Decision, Verdict, challenge
from ddpmon.web.config import WebConfig, WebConfigError, load_web_config
from ddpmon.web.framing import HttpError, encode_head, parse_request_head, reason
from ddpmon.web.limits import Limits, count_status, server_stats

__all__ = ["INDEX_HTML", "Limits", "MetricsServer", "PortInUseError", "WebConfigError"]

log = logging.getLogger("ddpmon.server")

INDEX_HTML = (
    b"<!doctype html><html><head><title>ddpmon</title></head>"
    b"<body><h1>ddpmon</h1><p><a href='/metrics'>metrics</a></p></body></html>"
)


class PortInUseError(OSError):
    """The configured port is taken; the message says which option moves it."""


@dataclass(slots=True)
class _AuthCheck:
    """A request parked while the auth worker checks its credentials."""

    conn: Conn
    decision: Decision
    method: str
    path: str
    keep: bool
    store: bool


class MetricsServer:
    def __init__(
        self,
        render: Callable[[], bytes],
        *,
        bind: str,
        port: int,
        web_config: str | None = None,
        content_type: str = CONTENT_TYPE_LATEST,
        limits: Limits | None = None,
        index_html: bytes = INDEX_HTML,
    ) -> None:
        self._render = render
        self._bind = bind
        self._requested_port = port
        self._web_config_path = web_config
        self._content_type = content_type
        self._index_html = index_html
        self.limits = limits or Limits()
        self._cfg: WebConfig | None = None
        self._loop: ConnectionLoop | None = None
        self._thread: threading.Thread | None = None
        self._auth_thread: threading.Thread | None = None
        self._auth_q: queue.Queue[_AuthCheck | None] = queue.Queue()
        self._gate = AuthGate(None, self.limits.max_auth_pending)
        self._port: int | None = None
        self._date_at, self._date_text = 0, ""
        self.stats: dict[str, int] = server_stats()
        """Counters for tests and debugging; ``status_<code>`` keys count responses."""
        self.deliveries = Deliveries()
        """Delivered /metrics answers: what the agent's close() waits on (linger)."""

    @property
    def port(self) -> int:
        return self._port if self._port is not None else self._requested_port

    @property
    def tls(self) -> bool:
        return self._cfg is not None and self._cfg.ssl_context is not None

    @property
    def _connections(self) -> ConnectionLoop:
        """The running loop; HTTP handlers only run on its thread, so it exists."""
        assert self._loop is not None
        return self._loop

    def start(self) -> None:
        """Validate web_config, bind, start the loop thread. Raises before serving anything."""
        if self._web_config_path:
            self._cfg = load_web_config(self._web_config_path)
            self._gate = AuthGate(self._cfg.auth, self.limits.max_auth_pending)
        try:
            infos = socket.getaddrinfo(
                self._bind, self._requested_port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
        except socket.gaierror as exc:
            raise OSError(f"bind={self._bind!r}: cannot resolve: {exc}") from None
        family, _, _, _, addr = infos[0]
        lsock = socket.socket(family, socket.SOCK_STREAM)
        try:
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind(addr)
            lsock.listen(128)
        except OSError as exc:
            lsock.close()
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(
                    exc.errno,
                    f"port {self._requested_port} on {self._bind} is already in use; "
                    "set another base port with port=... or DDPMON_PORT",
                ) from exc
            raise
        lsock.setblocking(False)
        self._port = lsock.getsockname()[1]
        loop = ConnectionLoop(
            lsock,
            limits=self.limits,
            ssl_context=self._cfg.ssl_context if self._cfg else None,
            stats=self.stats,
            on_input=self._process,
        )
        self._loop = loop
        self._thread = threading.Thread(target=loop.run, name="ddpmon-http", daemon=True)
        self._thread.start()
        if self._cfg is not None and self._cfg.auth is not None:
            self._auth_thread = threading.Thread(
                target=self._auth_worker, args=(loop,), name="ddpmon-http-auth", daemon=True
            )
            self._auth_thread.start()

    def close(self) -> None:
        """Stop serving, close every socket and join the threads. Idempotent."""
        if self._thread is None or self._loop is None:
            return
        self._loop.stop()
        self._thread.join(timeout=10)
        if self._auth_thread is not None:
            self._auth_q.put(None)
            self._auth_thread.join(timeout=10)
            self._auth_thread = None
        self._thread = None
        self._loop.close()

    # ---------------------------------------------------------------- HTTP

    def _process(self, conn: Conn) -> None:
        """Parse one request from ``inbuf`` if complete and answer (or start auth)."""
        try:
            request = parse_request_head(conn.inbuf, self.limits)
        except HttpError as exc:
            self._error(conn, exc.code)
            return
        except Exception:  # a parser bug costs this request a 400, never the answer
            log.exception("ddpmon: request head parser failed")
            self._error(conn, 400)
            return
        if request is None:
            if conn.eof and conn.inbuf.strip():
                self._error(conn, 400)  # the client half-closed inside a request head
            return  # incomplete: wait for more bytes (within the deadline)
        self.stats["requests"] += 1
        conn.served += 1
        keep = request.keep_alive and conn.served < self.limits.max_requests_per_connection
        method, path = request.method, request.path
        store = is_store_scraper(request.headers)
        decision = self._gate.decide(request.headers.get("authorization"))
        if decision.verdict is Verdict.REFUSE:
            self._respond(conn, 401, method, keep)
        elif decision.verdict is Verdict.BUSY:
            self._respond(conn, 503, method, False)
        elif decision.verdict is Verdict.CHECK:
            self._connections.park(conn)
            self._auth_q.put(_AuthCheck(conn, decision, method, path, keep, store))
        else:
            self._route(conn, method, path, keep, store)

    def _route(self, conn: Conn, method: str, path: str, keep: bool, store: bool) -> None:
        if path not in ("/metrics", "/"):
            self._respond(conn, 404, method, keep)
        elif method not in ("GET", "HEAD"):
            self._respond(conn, 405, method, keep, extra={"Allow": "GET, HEAD"})
        elif path == "/":
            self._respond(conn, 200, method, keep, self._index_html, "text/html; charset=utf-8")
        else:
            rendered_at = time.monotonic()
            try:
                body = self._render()
            except Exception:
                log.warning("ddpmon http: render failed", exc_info=True)
                self._respond(conn, 500, method, False)
                return
            sent = None
            if method == "GET":
                sent = functools.partial(self.deliveries.delivered, rendered_at, store)
            self._respond(conn, 200, method, keep, body, self._content_type, on_sent=sent)

    def _error(self, conn: Conn, code: int) -> None:
        conn.inbuf.clear()
        self._respond(conn, code, "GET", False)

    def _respond(
        self,
        conn: Conn,
        code: int,
        method: str,
        keep: bool,
        body: bytes | None = None,
        ctype: str = "text/plain; charset=utf-8",
        extra: dict[str, str] | None = None,
        on_sent: Callable[[], None] | None = None,
    ) -> None:
        extra = dict(extra or {})
        if self._cfg is not None:
            extra.update(self._cfg.headers)
        head, body = response_head(code, self._date(), ctype, keep, body, extra)
        count_status(self.stats, code)
        data = head + body if method != "HEAD" else head
        self._connections.respond(conn, data, close_after=not keep or conn.eof, on_sent=on_sent)

    def _date(self) -> str:
        now = int(time.time())
        if now != self._date_at:
            self._date_at, self._date_text = now, formatdate(now, usegmt=True)
        return self._date_text

    # ---------------------------------------------------------------- auth

    def _auth_worker(self, loop: ConnectionLoop) -> None:
        while True:
            check = self._auth_q.get()
            if check is None:
                return
            ok = self._gate.check(check.decision)
            loop.call_soon(functools.partial(self._finish_auth, check, ok))

    def _finish_auth(self, check: _AuthCheck, ok: bool) -> None:
        """On the loop thread: answer a request whose credentials have been checked."""
        self._gate.done()
        conn = check.conn
        if not self._connections.resume(conn):
            return
        try:
            if ok:
                self._route(conn, check.method, check.path, check.keep, check.store)
            else:
                self._respond(conn, 401, check.method, check.keep)
        except Exception:
            self.stats["errors"] += 1
            self._connections.drop(conn)


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
    headers = [
        ("Date", date),
        ("Content-Type", ctype),
        ("Content-Length", str(len(body))),
        ("Connection", "keep-alive" if keep else "close"),
    ]
    if code == 401:
        headers.append(("WWW-Authenticate", challenge("ddpmon")))
    headers.extend(extra.items())
    return encode_head(code, headers), body
