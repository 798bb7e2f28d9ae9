"""One HTTP core, two servers: the agent's /metrics endpoint (a selectors loop on a thread) and
the daemon's asyncio front hand their bytes to the same parser and keep the same deadlines, so
the same malformed request gets the same status from both, and a slow client is cut at the same
moment. Raw bytes against both real servers, in-process (a tiny ASGI app stands in for the
daemon's API)."""

from __future__ import annotations

import base64
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PASSWORD
from test_daemon_slow import closed_after, tiny_app
from test_server_http import raw, status_of

from ddpmon.daemon.server import DaemonLimits, DaemonServer
from ddpmon.export.server import Limits, MetricsServer
from ddpmon.web.config import load_web_config

pytestmark = pytest.mark.timeout(120)

HEAD = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"
TIMEOUT = 1.0
"""The request and idle times of both servers here (seconds)."""


@contextlib.contextmanager
def serve_daemon(web_config: Path | None = None) -> Iterator[DaemonServer]:
    limits = DaemonLimits(request_timeout=TIMEOUT, idle_timeout=TIMEOUT, max_body_bytes=10_000)
    web = load_web_config(web_config) if web_config is not None else None
    srv = DaemonServer(tiny_app, bind="127.0.0.1", port=0, token="t", limits=limits,
                       web_config=web)
    ready = threading.Event()
    thread = threading.Thread(target=srv.run, args=(ready.set,), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield srv
    finally:
        srv.stop()
        thread.join(10)


@pytest.fixture
def daemon() -> Iterator[DaemonServer]:
    with serve_daemon() as srv:
        yield srv


@pytest.fixture
def agent(make_server) -> MetricsServer:
    return make_server(limits=Limits(request_timeout=TIMEOUT, idle_timeout=TIMEOUT))


MALFORMED = {
    "http2-version": (b"GET /metrics HTTP/2.0\r\nHost: 127.0.0.1\r\n\r\n", 400),
    "no-version": (b"GET /metrics\r\n\r\n", 400),
    "two-spaces": (b"GET  /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 400),
    "absolute-form": (b"GET http://127.0.0.1/metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 400),
    "folded": (HEAD + b" folded: x\r\n\r\n", 400),
    "no-colon": (HEAD + b"NoColon\r\n\r\n", 400),
    "space-before-colon": (HEAD + b"X-A : b\r\n\r\n", 400),
    "control-in-value": (HEAD + b"X-A: a\x01b\r\n\r\n", 400),
    "two-hosts": (HEAD + b"Host: 127.0.0.1\r\n\r\n", 400),
    "two-lengths": (HEAD + b"Content-Length: 0\r\nContent-Length: 1\r\n\r\n", 400),
    "superscript-length": (HEAD + b"Content-Length: \xb2\r\n\r\n", 400),
    "negative-length": (HEAD + b"Content-Length: -1\r\n\r\n", 400),
    "length-and-chunked": (HEAD + b"Content-Length: 0\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
    "two-credentials": (HEAD + b"Authorization: Basic eDp5\r\nAuthorization: Basic eTp6\r\n\r\n",
                        400),
    "tls-hello": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400),
    "cut-short": (HEAD + b"Accept: */*\r\n", 400),  # then the client half-closes
    "long-line": (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 414),
    "many-fields": (HEAD + b"X-A: b\r\n" * 100 + b"\r\n", 431),
    "huge-field": (HEAD + b"X-Big: " + b"a" * 20_000 + b"\r\n\r\n", 431),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_the_same_malformed_request_gets_the_same_status_from_both(agent, daemon, name):
    request, expected = MALFORMED[name]
    replies = {"agent": raw(agent.port, request), "daemon": raw(daemon.port, request)}
    for server, reply in replies.items():
        assert status_of(reply) == expected, (server, reply[:200])
        assert reply.count(b"HTTP/1.1 ") == 1, (server, reply[:400])
        assert b"connection: close" in reply.lower(), (server, reply[:400])
    assert status_of(raw(agent.port, HEAD + b"Connection: close\r\n\r\n")) == 200
    assert status_of(raw(daemon.port, HEAD + b"Connection: close\r\n\r\n")) == 200


def test_a_slow_header_client_is_cut_at_the_same_deadline_on_both(agent, daemon):
    """One deadline from accept for the whole head: bytes trickling in do not extend it."""
    trickle = HEAD + b"X-Pad: " + b"a" * 200 + b"\r\n\r\n"
    cut = {}
    for name, srv in (("agent", agent), ("daemon", daemon)):
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:
            cut[name] = closed_after(sock, trickle, every=0.05)
        assert srv.stats["timed_out"] == 1, (name, srv.stats)
    print(f"\ntrickled head cut after: {cut}")
    for seconds in cut.values():
        assert 0.8 * TIMEOUT < seconds < 2.5 * TIMEOUT


def first_byte_to_close(port: int) -> tuple[float, float]:
    """On a kept-alive connection: wait idle for 0.6 s after a response, then trickle the next
    head. Returns (seconds from the response, seconds from the first byte) to the close."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(HEAD + b"\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += sock.recv(65536)
        answered = time.monotonic()
        time.sleep(0.6 * TIMEOUT)
        started = time.monotonic()
        closed_after(sock, HEAD + b"X-Pad: " + b"a" * 200 + b"\r\n\r\n", every=0.05)
        end = time.monotonic()
    return end - answered, end - started


def test_a_new_head_on_a_kept_alive_connection_gets_the_request_time_on_both(agent, daemon):
    """Idle time until the next request's first byte, then the request time from that byte
    (``Limits.next_head_deadline``): a head trickled after 0.6 s idle is cut one request time
    after its first byte, not when the idle time ends."""
    for name, srv in (("agent", agent), ("daemon", daemon)):
        since_response, since_first_byte = first_byte_to_close(srv.port)
        print(f"\n{name}: closed {since_response:.2f} s after the response, "
              f"{since_first_byte:.2f} s after the next head began")
        assert 0.8 * TIMEOUT < since_first_byte < 2.5 * TIMEOUT, name
        assert since_response > 1.3 * TIMEOUT, name


def test_a_chunked_body_is_answered_at_once_never_waited_for(agent, daemon):
    """Chunked bodies are not decoded: 411 where a body may come (send a Content-Length), 413
    at the endpoint, which takes none; both answer before the body is complete."""
    chunked = b"POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel"
    for srv, expected in ((daemon, 411), (agent, 413)):
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
            t0 = time.monotonic()
            sock.sendall(chunked)  # the body never ends
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
            elapsed = time.monotonic() - t0
        assert status_of(reply) == expected and elapsed < 0.8 * TIMEOUT, (reply[:200], elapsed)
    other = b"POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: gzip\r\n\r\n"
    assert status_of(raw(daemon.port, other)) == 400  # its length cannot be known at all


def test_a_length_framed_body_and_a_pipelined_request_on_the_daemon(daemon):
    body = b"x" * 3000
    post = b"POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 3000\r\n\r\n" + body
    reply = raw(daemon.port, post + b"GET /y HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert reply.count(b"HTTP/1.1 200 OK") == 2, reply
    assert b'{"path": "/x", "len": 3000}' in reply and b'{"path": "/y", "len": 0}' in reply
    too_big = b"POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 10001\r\n\r\n"
    assert status_of(raw(daemon.port, too_big)) == 413


def basic(user: str, password: str) -> bytes:
    return b"Authorization: Basic " + base64.b64encode(f"{user}:{password}".encode()) + b"\r\n"


def test_basic_auth_answers_the_same_on_both(make_server, tmp_path, pw_hash):
    """One gate (``ddpmon.web.auth``): the same credentials get the same answer, and a 401
    carries the same challenge but for its realm."""
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  prometheus: '{pw_hash}'\n")
    agent = make_server(web_config=path)
    cases = [
        (b"", 401),
        (b"Authorization: Basic !!!!\r\n", 401),
        (b"Authorization: Bearer t\r\n", 401),  # the daemon's token opens job routes only
        (basic("prometheus", "wrong"), 401),
        (basic("nobody", PASSWORD), 401),
        (basic("prometheus", PASSWORD), 200),
        (basic("prometheus", PASSWORD), 200),  # from the cache now
    ]
    with serve_daemon(path) as daemon:
        for credentials, expected in cases:
            for name, port in (("agent", agent.port), ("daemon", daemon.port)):
                reply = raw(port, HEAD + credentials + b"Connection: close\r\n\r\n")
                assert status_of(reply) == expected, (name, credentials, reply[:300])
                if expected == 401:
                    challenge = reply.lower().split(b"www-authenticate: ", 1)[1].split(b"\r\n")[0]
                    realm = b"ddpmon" if name == "agent" else b"ddpmon daemon"
                    assert challenge == b'basic realm="' + realm + b'", charset="utf-8"', name
