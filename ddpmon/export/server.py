"""The per-rank HTTP endpoint: serves ``render()`` on /metrics and nothing else.

It lives inside a training process, so a broken or hostile client must never slow or crash
training. One thread runs a ``selectors`` event loop over non-blocking sockets: TLS handshakes
advance without blocking, every connection has a deadline from accept (handshake plus request
headers) that trickling bytes do not extend, the connection count is capped (a newcomer evicts
the oldest connection that has not sent a full request yet, so idle or stalled clients cannot
lock real scrapes out), requests are size-limited, and only GET/HEAD of ``/metrics`` and ``/``
are served. bcrypt checks (tens of ms, GIL released) run on one worker thread so the loop keeps
serving; credentials that verified before are answered from ``BasicAuth``'s cache.

Interface used by the agent and the daemon: ``MetricsServer(render, bind=..., port=...,
web_config=None)``, ``.start()`` (``WebConfigError``, ``PortInUseError``), ``.port``,
``.close()``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import queue
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from email.utils import formatdate

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ddpmon.export.http11 import HttpError, Limits, parse_request_head, response_head
from ddpmon.export.webconfig import BasicAuth, WebConfig, WebConfigError, load_web_config

__all__ = ["INDEX_HTML", "Limits", "MetricsServer", "PortInUseError", "WebConfigError"]

log = logging.getLogger("ddpmon.server")

INDEX_HTML = (
    b"<!doctype html><html><head><title>ddpmon</title></head>"
    b"<body><h1>ddpmon</h1><p><a href='/metrics'>metrics</a></p></body></html>"
)
class PortInUseError(OSError):
    """The configured port is taken; the message says which option moves it."""


@dataclass(slots=True)
class _Conn:
    sock: socket.socket
    fd: int
    accepted: float
    deadline: float
    tls: bool
    state: str = "handshake"  # handshake | read | auth | write | linger
    inbuf: bytearray = field(default_factory=bytearray)
    out: memoryview | None = None
    close_after: bool = False
    served: int = 0
    eof: bool = False  # the client half-closed; answer what is buffered, then close
    pending: tuple[str, str, bool] | None = None  # (method, path, keep_alive) awaiting auth
    events: int = 0


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
        self._listener: socket.socket | None = None
        self._sel: selectors.BaseSelector | None = None
        self._conns: dict[int, _Conn] = {}
        self._ready: list[_Conn] = []
        self._thread: threading.Thread | None = None
        self._auth_thread: threading.Thread | None = None
        self._auth_q: queue.Queue[tuple[int, _Conn, bytes, bytes] | None] = queue.Queue()
        self._auth_done: queue.Queue[tuple[_Conn, bool]] = queue.Queue()
        self._auth_pending = 0
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._stop = threading.Event()
        self._port: int | None = None
        self._date_at, self._date_text = 0, ""
        self.stats: dict[str, int] = {
            "accepted": 0,
            "evicted": 0,
            "timed_out": 0,
            "tls_failed": 0,
            "requests": 0,
            "errors": 0,
        }
        """Counters for tests and debugging; ``status_<code>`` keys count responses."""

    @property
    def port(self) -> int:
        return self._port if self._port is not None else self._requested_port

    @property
    def tls(self) -> bool:
        return self._cfg is not None and self._cfg.ssl_context is not None

    def start(self) -> None:
        """Validate web_config, bind, start the loop thread. Raises before serving anything."""
        if self._web_config_path:
            self._cfg = load_web_config(self._web_config_path)
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
        self._listener = lsock
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(lsock, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="ddpmon-http", daemon=True)
        self._thread.start()
        if self._cfg is not None and self._cfg.auth is not None:
            self._auth_thread = threading.Thread(
                target=self._auth_worker, name="ddpmon-http-auth", daemon=True
            )
            self._auth_thread.start()

    def close(self) -> None:
        """Stop serving, close every socket and join the threads. Idempotent."""
        if self._thread is None:
            return
        self._stop.set()
        self._wake()
        self._thread.join(timeout=10)
        if self._auth_thread is not None:
            self._auth_q.put(None)
            self._auth_thread.join(timeout=10)
            self._auth_thread = None
        self._thread = None
        for sock in (self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
        self._wake_r = self._wake_w = None

    # ---------------------------------------------------------------- loop

    def _wake(self) -> None:
        if self._wake_w is not None:
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass

    def _loop(self) -> None:
        sel = self._sel
        assert sel is not None
        try:
            while not self._stop.is_set():
                timeout = self._next_timeout()
                try:
                    ready = sel.select(timeout)
                except OSError:  # pragma: no cover - EINTR is retried by Python
                    continue
                for key, mask in ready:
                    try:
                        if key.data == "listen":
                            self._accept()
                        elif key.data == "wake":
                            self._drain_wake()
                        elif self._conns.get(key.data.fd) is key.data:
                            self._on_event(key.data, mask)
                    except Exception:  # never let one client end the loop
                        self.stats["errors"] += 1
                        log.debug("ddpmon http: event failed", exc_info=True)
                        if isinstance(key.data, _Conn):
                            self._drop(key.data)
                self._finish_auth()
                self._run_ready()
                self._sweep()
        finally:
            for conn in list(self._conns.values()):
                self._drop(conn)
            sel.close()
            if self._listener is not None:
                self._listener.close()
                self._listener = None

    def _run_ready(self) -> None:
        ready, self._ready = self._ready, []
        for conn in ready:
            if self._conns.get(conn.fd) is not conn or conn.state != "read":
                continue
            try:
                self._process(conn)
                if self._finished_input(conn):
                    self._drop(conn)
            except Exception:
                self.stats["errors"] += 1
                self._drop(conn)

    def _finished_input(self, conn: _Conn) -> bool:
        """Half-closed, idle and nothing complete left to answer."""
        return (
            conn.eof
            and conn.state == "read"
            and self._conns.get(conn.fd) is conn
            and all(c is not conn for c in self._ready)
        )

    def _next_timeout(self) -> float:
        if self._ready or not self._auth_done.empty():
            return 0.0
        if not self._conns:
            return 1.0
        soonest = min(c.deadline for c in self._conns.values())
        return min(1.0, max(0.0, soonest - time.monotonic()))

    def _drain_wake(self) -> None:
        assert self._wake_r is not None
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _sweep(self) -> None:
        now = time.monotonic()
        for conn in list(self._conns.values()):
            if conn.deadline <= now and conn.state != "auth":
                if conn.state != "linger":
                    self.stats["timed_out"] += 1
                self._drop(conn)

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(64):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. EMFILE: shed load rather than spin
                self.stats["errors"] += 1
                return
            self.stats["accepted"] += 1
            if len(self._conns) >= self.limits.max_connections and not self._evict_one():
                sock.close()
                continue
            sock.setblocking(False)
            with contextlib.suppress(OSError):  # no Nagle wait behind TLS session tickets
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            now = time.monotonic()
            ctx = self._cfg.ssl_context if self._cfg else None
            if ctx is not None:
                try:
                    sock = ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                except (OSError, ValueError):
                    sock.close()
                    continue
            conn = _Conn(
                sock=sock,
                fd=sock.fileno(),
                accepted=now,
                deadline=now + self.limits.request_timeout,
                tls=ctx is not None,
                state="handshake" if ctx is not None else "read",
            )
            self._conns[conn.fd] = conn
            self._sel_set(conn, selectors.EVENT_READ)

    def _evict_one(self) -> bool:
        """Close the oldest connection that has no request in progress."""
        victims = [
            c for c in self._conns.values() if c.state in ("handshake", "read", "linger")
        ]
        if not victims:
            return False
        victim = min(victims, key=lambda c: c.accepted)
        self.stats["evicted"] += 1
        self._drop(victim)
        return True

    def _sel_set(self, conn: _Conn, events: int) -> None:
        assert self._sel is not None
        try:
            self._sel.modify(conn.sock, events, conn)
        except KeyError:
            self._sel.register(conn.sock, events, conn)

    def _sel_clear(self, conn: _Conn) -> None:
        assert self._sel is not None
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass

    def _drop(self, conn: _Conn) -> None:
        self._sel_clear(conn)
        if self._conns.get(conn.fd) is conn:
            del self._conns[conn.fd]
        try:
            conn.sock.close()
        except OSError:
            pass

    def _on_event(self, conn: _Conn, mask: int) -> None:
        if conn.state == "handshake":
            self._handshake(conn)
        elif conn.state == "read":
            self._read(conn)
        elif conn.state == "write":
            self._write(conn)
        elif conn.state == "linger":
            self._linger(conn)

    def _handshake(self, conn: _Conn) -> None:
        sock = conn.sock
        assert isinstance(sock, ssl.SSLSocket)
        try:
            sock.do_handshake()
        except ssl.SSLWantReadError:
            self._sel_set(conn, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._sel_set(conn, selectors.EVENT_WRITE)
            return
        except (ssl.SSLError, OSError, ValueError):
            self.stats["tls_failed"] += 1
            self._drop(conn)
            return
        conn.state = "read"
        self._sel_set(conn, selectors.EVENT_READ)
        self._read(conn)

    def _read(self, conn: _Conn) -> None:
        limit = self.limits.max_header_bytes + 1
        while len(conn.inbuf) < limit:
            try:
                chunk = conn.sock.recv(limit - len(conn.inbuf))
            except ssl.SSLWantReadError:
                break
            except ssl.SSLWantWriteError:
                self._sel_set(conn, selectors.EVENT_WRITE)  # renegotiation-like; rare
                return
            except (BlockingIOError, InterruptedError):
                break
            except (OSError, ssl.SSLError):
                self._drop(conn)
                return
            if not chunk:
                conn.eof = True
                break
            if conn.served and not conn.inbuf:  # a new request on a kept-alive connection
                conn.deadline = time.monotonic() + self.limits.request_timeout
            conn.inbuf += chunk
        self._process(conn)
        if self._finished_input(conn):
            self._drop(conn)  # half-closed with no complete request left

    # ---------------------------------------------------------------- HTTP

    def _process(self, conn: _Conn) -> None:
        """Parse one request from ``inbuf`` if complete and answer (or start auth)."""
        try:
            request = parse_request_head(conn.inbuf, self.limits)
        except HttpError as exc:
            self._error(conn, exc.code)
            return
        if request is None:
            return  # incomplete: wait for more bytes (within the deadline)
        self.stats["requests"] += 1
        conn.served += 1
        keep = request.keep_alive and conn.served < self.limits.max_requests_per_connection
        method, path = request.method, request.path
        auth = self._cfg.auth if self._cfg else None
        if auth is not None:
            creds = BasicAuth.parse_header(request.headers.get("authorization"))
            if creds is None:
                self._respond(conn, 401, method, keep)
                return
            if not auth.cached(*creds):
                if self._auth_pending >= self.limits.max_auth_pending:
                    self._respond(conn, 503, method, False)
                    return
                conn.state = "auth"
                conn.pending = (method, path, keep)
                self._sel_clear(conn)
                self._auth_pending += 1
                self._auth_q.put((id(conn), conn, *creds))
                return
        self._route(conn, method, path, keep)

    def _route(self, conn: _Conn, method: str, path: str, keep: bool) -> None:
        if path not in ("/metrics", "/"):
            self._respond(conn, 404, method, keep)
        elif method not in ("GET", "HEAD"):
            self._respond(conn, 405, method, keep, extra={"Allow": "GET, HEAD"})
        elif path == "/":
            self._respond(conn, 200, method, keep, self._index_html, "text/html; charset=utf-8")
        else:
            try:
                body = self._render()
            except Exception:
                log.warning("ddpmon http: render failed", exc_info=True)
                self._respond(conn, 500, method, False)
                return
            self._respond(conn, 200, method, keep, body, self._content_type)

    def _error(self, conn: _Conn, code: int) -> None:
        conn.inbuf.clear()
        self._respond(conn, code, "GET", False)

    def _respond(
        self,
        conn: _Conn,
        code: int,
        method: str,
        keep: bool,
        body: bytes | None = None,
        ctype: str = "text/plain; charset=utf-8",
        extra: dict[str, str] | None = None,
    ) -> None:
        extra = dict(extra or {})
        if self._cfg is not None:
            extra.update(self._cfg.headers)
        head, body = response_head(code, self._date(), ctype, keep, body, extra)
        key = f"status_{code}"
        self.stats[key] = self.stats.get(key, 0) + 1
        conn.out = memoryview(head + body if method != "HEAD" else head)
        conn.close_after = not keep or conn.eof
        conn.state = "write"
        conn.deadline = time.monotonic() + self.limits.write_timeout
        self._write(conn)

    def _date(self) -> str:
        now = int(time.time())
        if now != self._date_at:
            self._date_at, self._date_text = now, formatdate(now, usegmt=True)
        return self._date_text

    def _write(self, conn: _Conn) -> None:
        out = conn.out
        assert out is not None
        while out:
            try:
                n = conn.sock.send(out)
            except (ssl.SSLWantWriteError, BlockingIOError, InterruptedError):
                break
            except ssl.SSLWantReadError:
                self._sel_set(conn, selectors.EVENT_READ)
                conn.out = out
                return
            except (OSError, ssl.SSLError):
                self._drop(conn)
                return
            out = out[n:]
        conn.out = out
        if out:
            self._sel_set(conn, selectors.EVENT_WRITE)
            return
        conn.out = None
        if conn.close_after:
            if conn.eof and conn.inbuf:  # pipelined requests before the half-close
                conn.state = "read"
                self._ready.append(conn)
                return
            self._close_gracefully(conn)
            return
        conn.state = "read"
        conn.deadline = time.monotonic() + (
            self.limits.request_timeout if conn.inbuf else self.limits.idle_timeout
        )
        self._sel_set(conn, selectors.EVENT_READ)
        if conn.inbuf:  # pipelined request already buffered: next loop turn, one at a time
            self._ready.append(conn)

    def _close_gracefully(self, conn: _Conn) -> None:
        """Half-close, then discard what the client still sends for a moment before closing:
        closing with unread input makes the kernel send RST, which can destroy the response."""
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._drop(conn)
            return
        conn.state = "linger"
        conn.inbuf.clear()
        conn.deadline = time.monotonic() + 1.0
        self._sel_set(conn, selectors.EVENT_READ)

    def _linger(self, conn: _Conn) -> None:
        try:
            while conn.sock.recv(65536):
                pass
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
            return
        except (OSError, ssl.SSLError):
            pass
        self._drop(conn)

    # ---------------------------------------------------------------- auth

    def _auth_worker(self) -> None:
        auth = self._cfg.auth if self._cfg else None
        assert auth is not None
        while True:
            item = self._auth_q.get()
            if item is None:
                return
            _, conn, user, password = item
            try:
                ok = auth.check(user, password)
            except Exception:  # pragma: no cover - defensive
                ok = False
            self._auth_done.put((conn, ok))
            self._wake()

    def _finish_auth(self) -> None:
        while True:
            try:
                conn, ok = self._auth_done.get_nowait()
            except queue.Empty:
                return
            self._auth_pending -= 1
            if conn.state != "auth" or conn.pending is None:
                continue
            if self._conns.get(conn.fd) is not conn:
                continue
            method, path, keep = conn.pending
            conn.pending = None
            conn.state = "read"
            self._sel_set(conn, selectors.EVENT_READ)
            try:
                if ok:
                    self._route(conn, method, path, keep)
                else:
                    self._respond(conn, 401, method, keep)
            except Exception:
                self.stats["errors"] += 1
                self._drop(conn)
