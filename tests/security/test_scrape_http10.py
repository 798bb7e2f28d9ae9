"""The scrape client reads exporters that end their answer by closing the connection: Python's
``http.server`` (HTTP/1.0 by default, with or without Content-Length) and servers or proxies
that send ``Connection: close``. ``http.client`` hands the socket to the response after the
headers; the client once closed it there and failed with "Bad file descriptor". Such an answer
keeps the client's limits: a body past the size cap and a body that trickles past the deadline
still fail with the usual errors, and no socket is left open."""

from __future__ import annotations

import ssl
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from sec_pki import Pki

from ddpmon.export.scrape import (
    MAX_BODY_BYTES,
    ScrapeClient,
    ScrapeConfig,
    ScrapeError,
    TlsConfig,
)

SERIES = 20_000
EXPOSITION = (
    "# TYPE ddpmon_steps_total counter\nddpmon_steps_total 3\n"
    + "".join(f"# TYPE exporter_gauge_{i} gauge\nexporter_gauge_{i} {i}\n" for i in range(SERIES))
).encode()
"""Large enough (hundreds of KB) that the body takes many reads after the headers."""


class Exporter(BaseHTTPRequestHandler):
    """/metrics the way a small Python exporter serves it; the server's ``answer`` picks how."""

    server: ExporterServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        answer = self.server.answer
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        if answer == "oversize":
            self.end_headers()
            chunk = b"# " + b"x" * 65_533 + b"\n"
            for _ in range(MAX_BODY_BYTES // len(chunk) + 2):
                self.wfile.write(chunk)
            return
        if answer == "trickle":
            self.end_headers()
            for i in range(100):
                self.wfile.write(f"exporter_gauge_{i} {i}\n".encode())
                self.wfile.flush()
                time.sleep(0.2)
            return
        if answer in ("length", "close+length"):
            self.send_header("Content-Length", str(len(EXPOSITION)))
        if answer.startswith("close"):
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(EXPOSITION)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


class ExporterServer(ThreadingHTTPServer):
    daemon_threads = True
    answer = "length"

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # the client hung up on an oversize or trickling answer: what those tests want


@contextmanager
def serve(protocol: str, answer: str, tls: Pki | None = None) -> Iterator[str]:
    handler = type("Handler", (Exporter,), {"protocol_version": protocol})
    server = ExporterServer(("127.0.0.1", 0), handler)
    server.answer = answer
    if tls is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(tls.server_cert, tls.server_key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.mark.parametrize(
    ("protocol", "answer"),
    [
        ("HTTP/1.0", "length"),
        ("HTTP/1.0", "no-length"),
        ("HTTP/1.0", "close"),
        ("HTTP/1.1", "close"),
        ("HTTP/1.1", "close+length"),
        ("HTTP/1.1", "length"),  # keep-alive, the agent's own way: unchanged
    ],
)
def test_answers_that_close_the_connection_are_read_whole(protocol: str, answer: str) -> None:
    with serve(protocol, answer) as target:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            for _ in range(3):
                values = ScrapeClient().samples(target, timeout=10)
                assert values["ddpmon_steps_total"] == 3
                assert values[f"exporter_gauge_{SERIES - 1}"] == SERIES - 1
                assert len(values) == SERIES + 1
        leaks = [w for w in caught if issubclass(w.category, ResourceWarning)]
        assert not leaks, [str(w.message) for w in leaks]


def test_an_http10_exporter_behind_tls_is_read_whole(pki: Pki) -> None:
    client = ScrapeClient(ScrapeConfig(tls_config=TlsConfig(ca_file=pki.ca)))
    with serve("HTTP/1.0", "no-length", tls=pki) as target:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            values = client.samples(f"https://{target}", timeout=10)
        assert values["ddpmon_steps_total"] == 3 and len(values) == SERIES + 1
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


def test_a_close_delimited_body_past_the_size_cap_is_refused() -> None:
    with serve("HTTP/1.0", "oversize") as target:
        with pytest.raises(ScrapeError) as err:
            ScrapeClient().fetch(target, timeout=30)
        assert str(err.value) == (
            f"http://{target}/metrics: answer larger than {MAX_BODY_BYTES} bytes"
        )


def test_a_close_delimited_body_that_trickles_ends_at_the_deadline() -> None:
    with serve("HTTP/1.0", "trickle") as target:
        start = time.monotonic()
        with pytest.raises(ScrapeError) as err:
            ScrapeClient().fetch(target, timeout=1.0)
        held = time.monotonic() - start
        assert str(err.value) == f"http://{target}/metrics: no complete answer within 1 s"
        assert held < 5, f"the scrape held {held:.1f} s past its 1 s deadline"
