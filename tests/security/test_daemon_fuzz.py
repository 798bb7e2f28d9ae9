"""Raw-socket fuzz of the node daemon's HTTP surface (FastAPI + uvicorn), started with its CLI
on a free port in a temp dir: no 5xx, the process stays alive and keeps answering."""

from __future__ import annotations

import http.client
import json
import socket
import sys
import time
from pathlib import Path

import pytest
from conftest import helper

pytestmark = pytest.mark.timeout(120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def wait_healthy(port: int, proc, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, proc.output_path.read_text()[-3000:]
        try:
            if get(port, "/healthz")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError("daemon did not become healthy: " + proc.output_path.read_text()[-3000:])


def test_fuzz_daemon(spawn, tmp_path: Path) -> None:
    port = free_port()
    daemon = spawn(
        [sys.executable, "-m", "ddpmon.cli", "daemon", "--bind", "127.0.0.1", "--port", str(port),
         "--state-dir", str(tmp_path / "state"), "--node", "fuzz-node"],
        "daemon",
    )
    wait_healthy(port, daemon)
    fuzz = spawn(helper("sec_fuzz.py", "--port", port, "--requests", 3_000, "--seconds", 30,
                        "--daemon", "--seed", 23), "fuzz-daemon")
    fuzz.wait(timeout=60)
    report = json.loads(fuzz.output_path.read_text().splitlines()[-1])
    log = daemon.output_path.read_text(errors="replace")
    print(f"\nfuzz daemon: {json.dumps(report)}\ndaemon log lines: {len(log.splitlines())}")
    assert report["requests"] == 3_000
    fives = {code: n for code, n in report["statuses"].items() if code.startswith("5")}
    assert fives == {} and report["server_errors"] == []
    assert report["outcomes"].get("timeout", 0) == 0
    assert "Traceback" not in log, log[-3000:]
    assert daemon.poll() is None
    status, body = get(port, "/healthz")
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert get(port, "/metrics")[0] == 200
