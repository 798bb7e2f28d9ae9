"""The endpoint's connection layer: one ``selectors`` loop over non-blocking sockets.

It exists so that a hostile client costs training nothing but bookkeeping, with those rules
kept apart from what the bytes mean (``server.py``). It accepts, advances TLS handshakes without
blocking, reads up to the header limit, writes as the peer drains, closes gracefully (half-close,
then discard late input so the kernel sends no RST) and enforces the deadlines and the
connection cap of ``ddpmon.web.limits`` (the daemon's rules too): from accept (handshake plus
headers, not extended by trickling bytes), for writing, for keep-alive idling; at the cap a
newcomer evicts the oldest connection without a full request.

The HTTP layer plugs in through ``on_input`` (called on the loop thread when a connection has
buffered input) and answers through ``respond``, ``park``/``resume`` (a request waiting for
basic auth off the loop) and ``call_soon`` (the one thread-safe entry).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ddpmon.web.limits import Limits, oldest_idle

__all__ = ["Conn", "ConnectionLoop"]

log = logging.getLogger("ddpmon.server")


@dataclass(slots=True)
class Conn:
    """One accepted connection; ``inbuf``, ``eof`` and ``served`` are read by the HTTP layer."""

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
    on_sent: Callable[[], None] | None = None
    """Called on the loop thread once the current response's last byte reached the socket."""
    eof: bool = False  # the client half-closed; answer what is buffered, then close


class ConnectionLoop:
    """Owns the listener, the selector and every connection; ``run`` is the loop thread."""

    def __init__(
        self,
        listener: socket.socket,
        *,
        limits: Limits,
        ssl_context: ssl.SSLContext | None,
        stats: dict[str, int],
        on_input: Callable[[Conn], None],
    ) -> None:
        self.limits = limits
        self._listener: socket.socket | None = listener
        self._ssl_context = ssl_context
        self._stats = stats
        self._on_input = on_input
        self._conns: dict[int, Conn] = {}
        self._ready: list[Conn] = []
        self._callbacks: queue.Queue[Callable[[], None]] = queue.Queue()
        self._stop = threading.Event()
        self._wake_r: socket.socket | None
        self._wake_w: socket.socket | None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")

    # ---------------------------------------------------------------- control (any thread)

    def call_soon(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the loop thread after the current turn's socket events."""
        self._callbacks.put(callback)
        self._wake()

    def stop(self) -> None:
        """Ask ``run`` to close every connection and return."""
        self._stop.set()
        self._wake()

    def close(self) -> None:
        """Close the wake-up socket pair once ``run`` has returned."""
        for sock in (self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
        self._wake_r = self._wake_w = None

    def _wake(self) -> None:
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"x")

    # ---------------------------------------------------------------- used by the HTTP layer

    def respond(
        self,
        conn: Conn,
        data: bytes,
        *,
        close_after: bool,
        on_sent: Callable[[], None] | None = None,
    ) -> None:
        """Start writing ``data``; afterwards read the next request or close gracefully.
        ``on_sent``: called once every byte of ``data`` is in the socket (never if dropped)."""
        conn.out = memoryview(data)
        conn.on_sent = on_sent
        conn.close_after = close_after
        conn.state = "write"
        conn.deadline = self.limits.write_deadline(time.monotonic())
        self._write(conn)

    def park(self, conn: Conn) -> None:
        """Stop watching ``conn`` while its request waits off the loop (no deadline applies)."""
        conn.state = "auth"
        self._sel_clear(conn)

    def resume(self, conn: Conn) -> bool:
        """Watch a parked connection again; False when it was closed in the meantime."""
        if conn.state != "auth" or self._conns.get(conn.fd) is not conn:
            return False
        conn.state = "read"
        self._sel_set(conn, selectors.EVENT_READ)
        return True

    def drop(self, conn: Conn) -> None:
        """Close ``conn`` now and forget it."""
        self._sel_clear(conn)
        if self._conns.get(conn.fd) is conn:
            del self._conns[conn.fd]
        with contextlib.suppress(OSError):
            conn.sock.close()

    # ---------------------------------------------------------------- the loop

    def run(self) -> None:
        sel = self._sel
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
                        self._stats["errors"] += 1
                        log.debug("ddpmon http: event failed", exc_info=True)
                        if isinstance(key.data, Conn):
                            self.drop(key.data)
                self._run_callbacks()
                self._run_ready()
                self._sweep()
        finally:
            for conn in list(self._conns.values()):
                self.drop(conn)
            sel.close()
            if self._listener is not None:
                self._listener.close()
                self._listener = None

    def _run_callbacks(self) -> None:
        while True:
            try:
                callback = self._callbacks.get_nowait()
            except queue.Empty:
                return
            callback()

    def _run_ready(self) -> None:
        ready, self._ready = self._ready, []
        for conn in ready:
            if self._conns.get(conn.fd) is not conn or conn.state != "read":
                continue
            try:
                self._on_input(conn)
                if self._finished_input(conn):
                    self.drop(conn)
            except Exception:
                self._stats["errors"] += 1
                self.drop(conn)

    def _finished_input(self, conn: Conn) -> bool:
        """Half-closed, idle and nothing complete left to answer."""
        return (
            conn.eof
            and conn.state == "read"
            and self._conns.get(conn.fd) is conn
            and all(c is not conn for c in self._ready)
        )

    def _next_timeout(self) -> float:
        if self._ready or not self._callbacks.empty():
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
                    self._stats["timed_out"] += 1
                self.drop(conn)

    # ---------------------------------------------------------------- accept and evict

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(64):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. EMFILE: shed load rather than spin
                self._stats["errors"] += 1
                return
            self._stats["accepted"] += 1
            if len(self._conns) >= self.limits.max_connections and not self._evict_one():
                sock.close()
                continue
            sock.setblocking(False)
            with contextlib.suppress(OSError):  # no Nagle wait behind TLS session tickets
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            now = time.monotonic()
            ctx = self._ssl_context
            if ctx is not None:
                try:
                    sock = ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                except (OSError, ValueError):
                    sock.close()
                    continue
            conn = Conn(
                sock=sock,
                fd=sock.fileno(),
                accepted=now,
                deadline=self.limits.head_deadline(now),
                tls=ctx is not None,
                state="handshake" if ctx is not None else "read",
            )
            self._conns[conn.fd] = conn
            self._sel_set(conn, selectors.EVENT_READ)

    def _evict_one(self) -> bool:
        """Close the oldest connection that has no request in progress."""
        victim = oldest_idle(
            self._conns.values(),
            idle=lambda c: c.state in ("handshake", "read", "linger"),
            accepted=lambda c: c.accepted,
        )
        if victim is None:
            return False
        self._stats["evicted"] += 1
        self.drop(victim)
        return True

    def _sel_set(self, conn: Conn, events: int) -> None:
        try:
            self._sel.modify(conn.sock, events, conn)
        except KeyError:
            self._sel.register(conn.sock, events, conn)

    def _sel_clear(self, conn: Conn) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)

    # ---------------------------------------------------------------- socket I/O

    def _on_event(self, conn: Conn, mask: int) -> None:
        if conn.state == "handshake":
            self._handshake(conn)
        elif conn.state == "read":
            self._read(conn)
        elif conn.state == "write":
            self._write(conn)
        elif conn.state == "linger":
            self._linger(conn)

    def _handshake(self, conn: Conn) -> None:
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
            self._stats["tls_failed"] += 1
            self.drop(conn)
            return
        conn.state = "read"
        self._sel_set(conn, selectors.EVENT_READ)
        self._read(conn)

    def _read(self, conn: Conn) -> None:
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
                self.drop(conn)
                return
            if not chunk:
                conn.eof = True
                break
            if conn.served and not conn.inbuf:  # a new request on a kept-alive connection
                conn.deadline = self.limits.head_deadline(time.monotonic())
            conn.inbuf += chunk
        self._on_input(conn)
        if self._finished_input(conn):
            self.drop(conn)  # half-closed with no complete request left

    def _write(self, conn: Conn) -> None:
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
                self.drop(conn)
                return
            out = out[n:]
        conn.out = out
        if out:
            self._sel_set(conn, selectors.EVENT_WRITE)
            return
        conn.out = None
        if conn.on_sent is not None:
            sent, conn.on_sent = conn.on_sent, None
            sent()
        if conn.close_after:
            if conn.eof and conn.inbuf:  # pipelined requests before the half-close
                conn.state = "read"
                self._ready.append(conn)
                return
            self._close_gracefully(conn)
            return
        conn.state = "read"
        conn.deadline = self.limits.next_head_deadline(time.monotonic(), bool(conn.inbuf))
        self._sel_set(conn, selectors.EVENT_READ)
        if conn.inbuf:  # pipelined request already buffered: next loop turn, one at a time
            self._ready.append(conn)

    def _close_gracefully(self, conn: Conn) -> None:
        """Half-close, then discard what the client still sends for a moment before closing:
        closing with unread input makes the kernel send RST, which can destroy the response."""
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self.drop(conn)
            return
        conn.state = "linger"
        conn.inbuf.clear()
        conn.deadline = time.monotonic() + 1.0
        self._sel_set(conn, selectors.EVENT_READ)

    def _linger(self, conn: Conn) -> None:
        try:
            while conn.sock.recv(65536):
                pass
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
            return
        except (OSError, ssl.SSLError):
            pass
        self.drop(conn)
