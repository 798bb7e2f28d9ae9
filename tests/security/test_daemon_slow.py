"""Slow and idle clients against the daemon's HTTP front: the deadline from accept is not
extended by trickled bytes, idle connections are evicted at the cap so real requests still get
in, bodies and heads are bounded. In-process with tight limits (a tiny ASGI app stands in for
the API), then the real daemon with TLS + basic auth under the slow-client attacker while a
separate process scrapes it as Prometheus would."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from conftest import ANSWERED_WITHIN, helper, wait_for_line
from sec_daemon import start_daemon
from test_daemon_web_config import web_config

from ddpmon.daemon.server import DaemonLimits, DaemonServer

pytestmark = pytest.mark.timeout(120)


async def tiny_app(scope, receive, send) -> None:
    """Echo the request body length; a stand-in for the FastAPI app, real ASGI calls."""
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    if scope["path"] == "/slow":
        await asyncio.sleep(1.0)
    out = json.dumps({"path": scope["path"], "len": len(body)}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": out})


@pytest.fixture
def front() -> Iterator[DaemonServer]:
    limits = DaemonLimits(max_connections=8, max_in_flight=1, request_timeout=1.0, idle_timeout=1.0,
                          body_timeout=1.0, max_header_bytes=4096, max_body_bytes=1000)
    srv = DaemonServer(tiny_app, bind="127.0.0.1", port=0, token="t", limits=limits)
    ready = threading.Event()
    thread = threading.Thread(target=srv.run, args=(ready.set,), daemon=True)
    thread.start()
    assert ready.wait(10)
    yield srv
    srv.stop()
    thread.join(10)
    assert not thread.is_alive()


def get(port: int, path: str = "/x", body: bytes | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("POST" if body is not None else "GET", path, body=body)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def closed_after(sock: socket.socket, dribble: bytes = b"", every: float = 0.1) -> float:
    """Seconds until the server closes ``sock`` while it trickles ``dribble`` byte by byte."""
    t0 = time.monotonic()
    sock.settimeout(every)
    i = 0
    while time.monotonic() - t0 < 10:
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            pass
        except ConnectionError:
            return time.monotonic() - t0
        if i < len(dribble):
            try:
                sock.send(dribble[i:i + 1])
            except OSError:
                return time.monotonic() - t0
            i += 1
    return float("inf")


def test_head_deadline_is_not_extended_by_trickling(front):
    silent = socket.create_connection(("127.0.0.1", front.port))
    t_silent = closed_after(silent)
    trickle = socket.create_connection(("127.0.0.1", front.port))
    head = b"GET /x HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Pad: " + b"a" * 200 + b"\r\n\r\n"
    t_trickle = closed_after(trickle, head, every=0.05)
    silent.close(), trickle.close()
    print(f"\nclosed after: silent {t_silent:.2f} s, trickling {t_trickle:.2f} s")
    assert 0.8 < t_silent < 2.5 and 0.8 < t_trickle < 2.5
    assert front.stats["timed_out"] >= 2
    assert get(front.port) == 200


def test_idle_connections_do_not_lock_requests_out(front):
    idle = [socket.create_connection(("127.0.0.1", front.port)) for _ in range(30)]
    try:
        statuses = [get(front.port) for _ in range(10)]
    finally:
        for s in idle:
            s.close()
    print(f"\nstatuses with 30 idle sockets (cap 8): {statuses}; stats {front.stats}")
    assert statuses == [200] * 10
    assert front.stats["evicted"] >= 20


def test_body_and_head_bounds(front):
    assert get(front.port, body=b"x" * 500) == 200
    assert get(front.port, body=b"x" * 5000) == 413
    conn = socket.create_connection(("127.0.0.1", front.port))
    conn.sendall(b"POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n0123456789")
    assert 0.8 < closed_after(conn) < 2.5  # the body deadline, not the client, ends it
    conn.close()
    conn = socket.create_connection(("127.0.0.1", front.port))
    conn.sendall(b"GET /x HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 8000 + b"\r\n\r\n")
    assert conn.recv(100).startswith(b"HTTP/1.1 431")
    conn.close()


def test_in_flight_cap_answers_503_not_hangs(front):
    results: list[int] = []
    slow = threading.Thread(target=lambda: results.append(get(front.port, "/slow")))
    slow.start()
    time.sleep(0.3)
    assert get(front.port) == 503
    slow.join(5)
    assert results == [200] and get(front.port) == 200


def finished(scraper, attack) -> tuple[list, dict, list[float]]:
    """The scraper's (latency, status) pairs, the attacker's report and the sorted latencies,
    once both helper processes are done."""
    scraper.wait(timeout=40)
    attack.wait(timeout=40)
    results = json.loads(scraper.output_path.read_text().splitlines()[-1])
    report = json.loads(attack.output_path.read_text().splitlines()[-1])
    return results, report, sorted(lat for lat, _ in results)


def test_real_daemon_under_slow_clients(spawn, tmp_path, pki, pw_hash):
    """More slow sockets than the daemon's connection cap (128): scrapes keep getting 200."""
    _, port = start_daemon(spawn, tmp_path, "slow", "--web-config",
                           str(web_config(tmp_path, pki, pw_hash)))
    attack = spawn(helper("sec_slow.py", "--port", port, "--idle", 150, "--handshakes", 40,
                          "--seconds", 10), "attack")
    wait_for_line(attack.output_path, "ready", 30)
    scraper = spawn(helper("sec_scrape.py", "--port", port, "--cafile", pki.ca, "--user",
                           "prometheus", "--password", "s3cret-pass", "--seconds", 8), "scrape")
    results, report, latencies = finished(scraper, attack)
    print(f"\nattack: {report}\nscrapes: {len(results)}, statuses "
          f"{sorted({s for _, s in results})}, median {latencies[len(latencies) // 2] * 1e3:.1f}"
          f" ms, max {latencies[-1] * 1e3:.1f} ms")
    assert report["opened"]["idle"] >= 50 and report["opened"]["stalled_handshake"] >= 40
    assert {s for _, s in results} == {200} and len(results) >= 15
    assert latencies[-1] < ANSWERED_WITHIN


def test_real_daemon_under_slow_bodies_heads_and_idle_sockets(spawn, tmp_path):
    """One client floods the plain daemon with 80 slow request bodies (job submissions and rank
    registrations, the lock-out of issue 30), 40 trickled heads and 40 idle sockets, all
    reopened when dropped: over its cap of 128, while scrapes, /sd and an API read keep getting
    200 from another process."""
    _, port = start_daemon(spawn, tmp_path, "bodies")
    attack = spawn(helper("sec_slow.py", "--port", port, "--plain", "--idle", 80,
                          "--handshakes", 0, "--bodies", 80, "--seconds", 7), "attack")
    wait_for_line(attack.output_path, "ready", 30)
    scraper = spawn(helper("sec_scrape.py", "--port", port, "--plain", "--path", "/metrics",
                           "--path", "/sd", "--path", "/api/v1/jobs", "--seconds", 5), "scrape")
    results, report, latencies = finished(scraper, attack)
    print(f"\nattack: {report}\nrequests: {len(results)}, statuses "
          f"{sorted({str(s) for _, s in results})}, max {latencies[-1] * 1e3:.1f} ms")
    assert report["opened"]["slow_body"] >= 80 and report["opened"]["slowloris"] >= 40
    assert report["dropped_by_server"]["slow_body"] > 0  # evicted or timed out, not held
    assert {s for _, s in results} == {200} and len(results) >= 15
    assert latencies[-1] < ANSWERED_WITHIN
