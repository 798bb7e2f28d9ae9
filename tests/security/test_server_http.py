"""HTTP surface of the per-rank endpoint: what is served, what is refused, and how."""

from __future__ import annotations

import socket
import time

import pytest
from conftest import BODY, fetch
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ddpmon.export.server import Limits, MetricsServer, PortInUseError


def raw(port: int, data: bytes, timeout: float = 3.0) -> bytes:
    """Send raw bytes, half-close, return everything the server sends back."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def status_of(reply: bytes) -> int:
    assert reply.startswith(b"HTTP/1.1 "), reply[:80]
    return int(reply[9:12])


def test_metrics_and_index(make_server):
    srv = make_server()
    status, headers, body = fetch(srv.port)
    assert (status, body) == (200, BODY)
    assert headers["content-type"] == CONTENT_TYPE_LATEST
    status, headers, body = fetch(srv.port, "/")
    assert status == 200 and b"/metrics" in body and headers["content-type"].startswith("text/html")
    status, headers, body = fetch(srv.port, "/metrics?name[]=x", method="HEAD")
    assert status == 200 and body == b"" and headers["content-length"] == str(len(BODY))


@pytest.mark.parametrize(
    ("method", "path", "code"),
    [
        ("POST", "/metrics", 405),
        ("PUT", "/", 405),
        ("DELETE", "/metrics", 405),
        ("OPTIONS", "/metrics", 405),
        ("GET", "/metrics/", 404),
        ("GET", "/admin", 404),
        ("GET", "/../etc/passwd", 404),
        ("POST", "/nope", 404),
    ],
)
def test_only_get_head_on_two_paths(make_server, method, path, code):
    srv = make_server()
    status, headers, _ = fetch(srv.port, path, method=method)
    assert status == code
    if code == 405:
        assert headers["allow"] == "GET, HEAD"


@pytest.mark.parametrize(
    ("request_bytes", "code"),
    [
        (b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431),
        (b"GET /metrics HTTP/1.1\r\n" + b"X-A: b\r\n" * 100 + b"\r\n", 431),
        (b"GET /" + b"a" * 3000 + b" HTTP/1.1\r\n\r\n", 414),
        (b"GET /metrics HTTP/1.1\r\nContent-Length: 10\r\n\r\n0123456789", 413),
        (b"GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 413),
        (b"GET /metrics HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
        (b"GET /metrics\r\n\r\n", 400),
        (b"GET /metrics HTTP/2.0\r\n\r\n", 400),  # a client's fault is never 5xx
        (b"G\x00T /metrics HTTP/1.1\r\n\r\n", 400),
        (b"GET metrics HTTP/1.1\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\n folded: header\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\nNoColon\r\n\r\n", 400),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400),
    ],
)
def test_malformed_and_oversized_refused(make_server, request_bytes, code):
    srv = make_server()
    assert status_of(raw(srv.port, request_bytes)) == code
    assert fetch(srv.port)[0] == 200


def test_keep_alive_and_pipelining(make_server):
    srv = make_server()
    req = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    reply = raw(srv.port, req * 3 + b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert reply.count(b"HTTP/1.1 200 OK") == 4
    assert reply.count(BODY) == 3
    assert srv.stats["accepted"] == 1


def test_idle_connection_is_closed_after_request_timeout(make_server):
    srv = make_server(limits=Limits(request_timeout=0.5))
    with socket.create_connection(("127.0.0.1", srv.port), timeout=3) as s:
        t0 = time.monotonic()
        s.sendall(b"GET /metr")  # never finishes
        assert s.recv(100) == b""
        elapsed = time.monotonic() - t0
    assert 0.4 < elapsed < 2.0
    assert srv.stats["timed_out"] == 1


def test_connection_cap_evicts_oldest_idle(make_server):
    srv = make_server(limits=Limits(max_connections=8))
    idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=3) for _ in range(20)]
    try:
        t0 = time.monotonic()
        assert fetch(srv.port)[0] == 200
        assert time.monotonic() - t0 < 1.0
        assert srv.stats["evicted"] >= 12
    finally:
        for s in idle:
            s.close()


def test_render_error_is_500_and_server_survives(make_server):
    calls = []

    def render() -> bytes:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return BODY

    srv = make_server(render=render)
    assert fetch(srv.port)[0] == 500
    assert fetch(srv.port)[:3:2] == (200, BODY)


def test_port_in_use_names_the_option(make_server):
    srv = make_server()
    other = MetricsServer(lambda: b"", bind="127.0.0.1", port=srv.port)
    with pytest.raises(PortInUseError, match=rf"port {srv.port} .*port=\.\.\. or DDPMON_PORT"):
        other.start()


def test_close_is_idempotent_and_frees_the_port():
    srv = MetricsServer(lambda: BODY, bind="127.0.0.1", port=0)
    srv.start()
    port = srv.port
    assert fetch(port)[0] == 200
    srv.close()
    srv.close()
    with pytest.raises(OSError):
        fetch(port, timeout=1)
    again = MetricsServer(lambda: BODY, bind="127.0.0.1", port=port)
    again.start()
    try:
        assert fetch(port)[0] == 200
    finally:
        again.close()


def test_client_that_never_reads_is_dropped_after_write_timeout(make_server):
    big = b"x" * (64 * 1024 * 1024)  # far beyond loopback socket buffers
    srv = make_server(render=lambda: big, limits=Limits(write_timeout=0.5))
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
        time.sleep(1.5)  # never read while the deadline passes
        assert srv.stats["timed_out"] == 1
    t0 = time.monotonic()
    assert fetch(srv.port, "/")[0] == 200
    assert time.monotonic() - t0 < 1.0
