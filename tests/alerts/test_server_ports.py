"""A server ddpmon starts (``make stack``, the tests' Prometheus and VictoriaMetrics) is ready
only when *it* answers: a port probed free can be taken by another server before ours binds it,
and that one answers the readiness URL while ours is still failing to bind. Found as a flake
beside a CPU hog: promtool's rule backfill evaluated against another test's Prometheus."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ddpmon.services.process import StackError
from ddpmon.services.prometheus import Prometheus
from ddpmon.services.victoria import VictoriaMetrics


class _Impostor(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the http.server hook
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ready")

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def taken_port():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Impostor)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("kind", ["prometheus", "victoriametrics"])
def test_another_server_answering_on_the_port_is_not_taken_for_ours(kind, taken_port, tmp_path):
    server = (Prometheus(tmp_path / "prom", sd_dir=tmp_path / "sd", port=taken_port)
              if kind == "prometheus" else VictoriaMetrics(tmp_path / "vm", port=taken_port))
    try:
        with pytest.raises(StackError, match="exited with"):
            server.start(timeout=60)
        assert "address already in use" in server._process.log_tail().lower()
    finally:
        server.stop()
