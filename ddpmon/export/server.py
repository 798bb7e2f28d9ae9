"""The per-rank HTTP endpoint. It serves bytes produced by ``render`` and nothing else.

Interface used by the agent and the daemon (kept stable while the internals are hardened):
``MetricsServer(render, bind=..., port=..., web_config=None)``, ``.start()``, ``.port``,
``.close()``. ``start()`` raises ``PortInUseError`` naming the port.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.exposition import CONTENT_TYPE_LATEST

INDEX_HTML = b"<html><head><title>ddpmon</title></head><body><a href='/metrics'>metrics</a></body></html>"


class PortInUseError(OSError):
    """The configured port is taken; the message says which option moves it."""


class MetricsServer:
    def __init__(
        self,
        render: Callable[[], bytes],
        *,
        bind: str,
        port: int,
        web_config: str | None = None,
        content_type: str = CONTENT_TYPE_LATEST,
    ) -> None:
        self._render = render
        self._bind = bind
        self._requested_port = port
        self._web_config = web_config
        self._content_type = content_type
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._httpd.server_address[1] if self._httpd else self._requested_port

    def start(self) -> None:
        render, content_type = self._render, self._content_type

        class Handler(BaseHTTPRequestHandler):
            timeout = 10

            def _serve(self, body: bool) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    payload, ctype = render(), content_type
                elif path == "/":
                    payload, ctype = INDEX_HTML, "text/html; charset=utf-8"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if body:
                    self.wfile.write(payload)

            def do_GET(self) -> None:  # noqa: N802
                self._serve(True)

            def do_HEAD(self) -> None:  # noqa: N802
                self._serve(False)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                return

        try:
            httpd = ThreadingHTTPServer((self._bind, self._requested_port), Handler)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(
                    exc.errno,
                    f"port {self._requested_port} on {self._bind} is already in use; "
                    "set another base port with port=... or DDPMON_PORT",
                ) from exc
            raise
        httpd.daemon_threads = True
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, name="ddpmon-http", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
