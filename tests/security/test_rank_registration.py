"""Spoofed ranks: registration is accepted only over the daemon's agent socket, for the calling
process itself (SO_PEERCRED), on a host of this node, on a port that process listens on, and
never over a live entry of another process. Against the real daemon CLI."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from sec_daemon import start_daemon
from test_daemon_web_config import call

from tests.support.agent_call import call as agent_call
from tests.support.agent_call import wait_for_socket

ROOT = Path(__file__).resolve().parents[2]


def other_process(sock: Path, method: str, target: str, body: dict | None = None) -> int:
    """The same call made by a separate process (its own PID at the socket)."""
    argv = [sys.executable, "-m", "tests.support.agent_call", str(sock), method, target]
    if body is not None:
        argv.append(json.dumps(body))
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    return int(out.stdout.split()[0])


@pytest.fixture
def endpoint():
    """This test process's own listening port: what an agent registers."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        yield srv.getsockname()[1]


def sd_targets(port: int) -> list[str]:
    status, _, body = call(port, "/sd")
    assert status == 200, body
    return [t for group in json.loads(body) for t in group["targets"]]


def test_registration_over_tcp_is_refused_before_its_body_and_names_the_socket(spawn, tmp_path):
    proc, port = start_daemon(spawn, tmp_path, "a")
    sock = tmp_path / "a-state" / "agent.sock"
    wait_for_socket(sock)
    spoof = {"run": "r", "rank": 0, "pid": 1, "port": 9100, "host": "169.254.169.254"}
    status, _, body = call(port, "/api/v1/ranks", method="POST", body=spoof)
    assert status == 403, body
    assert json.loads(body)["agent_socket"] == str(sock)
    assert call(port, "/api/v1/ranks/r/0", method="DELETE")[0] == 403
    assert sd_targets(port) == []


def test_a_rank_registers_only_itself_on_this_node(spawn, tmp_path, endpoint):
    # A state dir deeper than a Unix socket path may be (108 bytes): reached through its fd.
    name = "deep-" + "d" * 90
    proc, port = start_daemon(spawn, tmp_path, name)
    sock = tmp_path / f"{name}-state" / "agent.sock"
    assert len(os.fsencode(sock)) > 108
    wait_for_socket(sock)
    own = {"run": "r", "rank": 0, "port": endpoint, "host": "127.0.0.1", "node": "n"}

    status, doc = agent_call(sock, "POST", "/api/v1/ranks", {**own, "pid": 1})
    assert status == 403 and "not the caller's own" in doc["error"], doc
    status, doc = agent_call(sock, "POST", "/api/v1/ranks", {**own, "host": "169.254.169.254"})
    assert status == 400 and "not an address or a name of this node" in doc["error"], doc
    with socket.create_server(("127.0.0.1", 0)) as other:
        unused = other.getsockname()[1]
    status, doc = agent_call(sock, "POST", "/api/v1/ranks", {**own, "port": unused})
    assert status == 400 and "does not listen on port" in doc["error"], doc
    assert sd_targets(port) == []

    status, doc = agent_call(sock, "POST", "/api/v1/ranks", own)
    assert status == 201, doc
    assert sd_targets(port) == [f"127.0.0.1:{endpoint}"]

    # Another live process can neither take the rank over nor remove it.
    assert other_process(sock, "POST", "/api/v1/ranks", {**own, "port": 0}) == 409
    assert other_process(sock, "DELETE", "/api/v1/ranks/r/0") == 403
    assert sd_targets(port) == [f"127.0.0.1:{endpoint}"]
    assert agent_call(sock, "DELETE", "/api/v1/ranks/r/0")[0] == 200
    assert sd_targets(port) == []

    # A rank whose process died may be taken by the next one (a restart).
    assert other_process(sock, "POST", "/api/v1/ranks", {**own, "rank": 1, "port": 0}) == 201
    assert agent_call(sock, "POST", "/api/v1/ranks", {**own, "rank": 1})[0] == 201
    assert sd_targets(port) == [f"127.0.0.1:{endpoint}"]


def test_the_agent_client_follows_the_daemon_to_its_socket(spawn, tmp_path, endpoint, monkeypatch):
    """An agent configured with the daemon's HTTP URL only (no $DDPMON_DAEMON_SOCKET) learns the
    socket from the refusal and registers there; ``unix:PATH`` works as the URL too."""
    from ddpmon.export import registration as client

    monkeypatch.delenv("DDPMON_DAEMON_SOCKET", raising=False)
    monkeypatch.setattr(client, "_learned", {})
    proc, port = start_daemon(spawn, tmp_path, "c")
    sock = tmp_path / "c-state" / "agent.sock"
    wait_for_socket(sock)
    info = {"run": "c1", "rank": "0", "local_rank": "0", "node": "n",
            "port": endpoint, "target": f"127.0.0.1:{endpoint}", "job_id": ""}  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    client.register_rank(url, info)
    assert sd_targets(port) == [f"127.0.0.1:{endpoint}"]
    client.deregister_rank(url, info)
    assert sd_targets(port) == []
    client.register_rank(f"unix:{sock}", {**info, "rank": "1"})
    assert sd_targets(port) == [f"127.0.0.1:{endpoint}"]


def test_state_dir_and_database_are_tightened_to_the_daemon_user(spawn, tmp_path):
    state = tmp_path / "p-state"
    state.mkdir(mode=0o755)
    os.chmod(state, 0o755)
    db = state / "ddpmon.sqlite3"
    db.touch()
    os.chmod(db, 0o644)
    proc, port = start_daemon(spawn, tmp_path, "p", existing=True)
    wait_for_socket(state / "agent.sock")
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    for path in state.glob("ddpmon.sqlite3*"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert "was mode 755; now 700" in proc.output_path.read_text()
