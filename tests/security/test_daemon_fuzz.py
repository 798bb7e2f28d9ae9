"""Raw-socket fuzz of the node daemon's HTTP surface (its asyncio front + FastAPI), started
with its CLI on a free port in a temp dir: no 5xx, the process stays alive and keeps answering."""

from __future__ import annotations

import http.client
import json
import sys
import time
from pathlib import Path

import pytest
from conftest import helper

from tests.support.ports import free_port

pytestmark = pytest.mark.timeout(120)


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
        [
            sys.executable,
            "-m",
            "ddpmon.cli",
            "daemon",
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--state-dir",
            str(tmp_path / "state"),
            "--node",
            "fuzz-node",
        ],
        "daemon",
    )
    wait_healthy(port, daemon)
    fuzz = spawn(
        helper(
            "sec_fuzz.py",
            "--port",
            port,
            "--requests",
            3_000,
            "--seconds",
            30,
            "--daemon",
            "--seed",
            23,
        ),
        "fuzz-daemon",
    )
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


def _fuzz(spawn, port: int, requests: int, seed: int, name: str) -> dict:
    fuzz = spawn(
        helper(
            "sec_fuzz.py",
            "--port",
            port,
            "--requests",
            requests,
            "--seconds",
            30,
            "--daemon",
            "--seed",
            seed,
        ),
        name,
    )
    fuzz.wait(timeout=60)
    return json.loads(fuzz.output_path.read_text().splitlines()[-1])


def test_fuzz_daemon_with_web_config(spawn, tmp_path: Path, pki, pw_hash) -> None:
    """Junk at a basic-auth daemon (plain HTTP) and at a TLS one: no 5xx, nothing gets past
    auth, the daemon stays up and still serves the real client."""
    from conftest import PASSWORD, client_ctx
    from sec_daemon import start_daemon
    from test_daemon_web_config import call, web_config

    auth_only = tmp_path / "auth.yml"
    auth_only.write_text(f"basic_auth_users:\n  prometheus: '{pw_hash}'\n")
    plain, plain_port = start_daemon(spawn, tmp_path, "auth", "--web-config", str(auth_only))
    report = _fuzz(spawn, plain_port, 2_000, 29, "fuzz-auth")
    print(f"\nfuzz basic-auth daemon: {json.dumps(report)}")
    assert report["requests"] == 2_000 and report["server_errors"] == []
    assert not [c for c in report["statuses"] if c.startswith("5")]
    assert report["statuses"].get("200", 0) == 0 and report["statuses"].get("401", 0) > 100
    assert report["outcomes"].get("timeout", 0) == 0 and plain.poll() is None
    assert call(plain_port, "/metrics", auth=("prometheus", PASSWORD))[0] == 200

    tls, tls_port = start_daemon(
        spawn, tmp_path, "tls", "--web-config", str(web_config(tmp_path, pki, pw_hash))
    )
    report = _fuzz(spawn, tls_port, 1_000, 31, "fuzz-tls")
    print(f"fuzz TLS daemon: {json.dumps(report)}")
    assert report["requests"] == 1_000 and report["statuses"] == {}
    assert report["outcomes"].get("timeout", 0) == 0 and tls.poll() is None
    assert call(tls_port, "/metrics", ctx=client_ctx(pki), auth=("prometheus", PASSWORD))[0] == 200
    for proc in (plain, tls):
        assert "Traceback" not in proc.output_path.read_text(errors="replace")
