"""DNS rebinding, cross-origin requests and slow bodies against the daemon's HTTP front.

A rebinding page reaches the daemon from the operator's browser with its own name in ``Host``;
a plain cross-origin page sends its ``Origin``. Both are refused before anything else runs (421
and 403), while Prometheus, curl and the agents, which send this host's name or address and no
``Origin``, are served. Connections still sending a body stay evictable, so a flood of slow
bodies cannot lock a scrape out. In-process (a tiny ASGI app stands in for the API), then the
real daemon."""

from __future__ import annotations

import http.client
import socket
import threading
from collections.abc import Iterator

import pytest
from sec_daemon import start_daemon
from test_daemon_slow import tiny_app

from ddpmon.daemon.server import DaemonLimits, DaemonServer
from ddpmon.web import hostcheck

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def front() -> Iterator[DaemonServer]:
    limits = DaemonLimits(max_connections=8, max_in_flight=4, request_timeout=2.0, idle_timeout=2.0,
                          body_timeout=8.0, max_body_bytes=10_000)
    names = hostcheck.host_names("127.0.0.1", "node-a", ["prom-alias.example"])
    srv = DaemonServer(tiny_app, bind="127.0.0.1", port=0, token="t", limits=limits,
                       host_names=names)
    ready = threading.Event()
    thread = threading.Thread(target=srv.run, args=(ready.set,), daemon=True)
    thread.start()
    assert ready.wait(10)
    yield srv
    srv.stop()
    thread.join(10)


def status(port: int, headers: dict[str, str], path: str = "/api/v1/jobs") -> int:
    """GET with exactly these headers (``Host`` included: http.client's own is skipped)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
        for key, value in headers.items():
            conn.putheader(key, value)
        conn.endheaders()
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"Host": "evil.example"}, 421),  # a rebound name
        ({"Host": "evil.example:7469"}, 421),
        ({"Host": "127.0.0.1.evil.example"}, 421),
        ({"Host": "user@127.0.0.1"}, 421),
        ({"Host": ""}, 421),
        ({"Host": "127.0.0.1:7469"}, 200),  # what Prometheus and curl send
        ({"Host": "localhost"}, 200),
        ({"Host": "[::1]:7469"}, 200),
        ({"Host": "node-a:7469"}, 200),  # the node label
        ({"Host": "PROM-ALIAS.example."}, 200),  # --allowed-host, any case, trailing dot
        ({"Host": "127.0.0.1", "Origin": "http://evil.example"}, 403),  # a cross-origin page
        ({"Host": "127.0.0.1", "Origin": "null"}, 403),
        ({"Host": "127.0.0.1", "Sec-Fetch-Site": "cross-site"}, 403),
        ({"Host": "127.0.0.1", "Origin": "http://127.0.0.1:7469"}, 200),  # same origin
    ],
)
def test_host_and_origin(front, headers, expected):
    assert status(front.port, headers) == expected


def test_registration_is_refused_from_another_host_before_its_body():
    # peer and local addresses as a connection reports them
    assert not hostcheck.host_allowed("10.1.2.3", "127.0.0.1", frozenset())
    assert not hostcheck.host_allowed("10.1.2.3", "10.1.2.4", frozenset())
    assert hostcheck.host_allowed("10.1.2.4", "10.1.2.4", frozenset())  # this node, its address
    assert hostcheck.host_allowed("::ffff:127.0.0.1", "127.0.0.1", frozenset())
    assert hostcheck.host_allowed("127.0.0.5", "127.0.0.1", frozenset())


def test_slow_bodies_do_not_lock_requests_out(front):
    """8 connections (the cap) each trickle a declared 1,000-byte body: they are not handling
    a request yet, so newcomers evict them and are served."""
    slow = []
    for _ in range(8):
        s = socket.create_connection(("127.0.0.1", front.port))
        s.sendall(b"POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\nab")
        slow.append(s)
    try:
        statuses = [status(front.port, {"Host": "127.0.0.1"}, "/x") for _ in range(5)]
    finally:
        for s in slow:
            s.close()
    print(f"\nstatuses beside 8 slow bodies (cap 8): {statuses}; stats {front.stats}")
    assert statuses == [200] * 5
    assert front.stats["evicted"] >= 1 and front.stats["rejected_busy"] == 0


def test_the_real_daemon_refuses_a_rebinding_request_and_serves_prometheus(spawn, tmp_path):
    daemon, port = start_daemon(spawn, tmp_path, "rebind")
    assert status(port, {"Host": "attacker.example"}, "/api/v1/jobs") == 421
    assert status(port, {"Host": "attacker.example"}, "/sd") == 421
    assert status(port, {"Host": "127.0.0.1", "Origin": "http://attacker.example"},
                  "/api/v1/jobs") == 403
    assert status(port, {"Host": f"127.0.0.1:{port}"}, "/metrics") == 200
    assert status(port, {"Host": "rebind-node"}, "/sd") == 200  # its node label
    assert daemon.poll() is None
