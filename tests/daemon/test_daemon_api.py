"""The daemon's HTTP contract against a real daemon process: auth, validation, errors,
discovery, OpenAPI. Jobs here use the cheap ``sleeper`` entry point."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.agent_call import call as agent_call
from tests.support.agent_call import wait_for_socket

from .conftest import Daemon

ROOT = Path(__file__).resolve().parents[2]


def test_token_file_created_private(daemon: Daemon) -> None:
    path = daemon.state_dir / "token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(daemon.token) >= 32


def test_mutations_need_the_token(daemon: Daemon) -> None:
    body = {"id": "t1", "entrypoint": "sleeper", "nproc": 1, "args": ["1"]}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": daemon.token}):
        resp = httpx.post(daemon.url + "/api/v1/jobs", json=body, headers=headers)
        assert resp.status_code == 401, resp.text
        assert "token" in resp.json()["error"]
        assert resp.headers["www-authenticate"] == "Bearer"
    resp = httpx.delete(daemon.url + "/api/v1/jobs/t1")
    assert resp.status_code == 401
    assert daemon.get("/api/v1/jobs/t1").status_code == 404  # nothing was created


def test_invalid_input_is_400_with_a_clear_error(daemon: Daemon) -> None:
    cases = {
        "bad id": ({"id": "../etc", "entrypoint": "sleeper", "nproc": 1}, "id"),
        "long id": ({"id": "a" * 65, "entrypoint": "sleeper", "nproc": 1}, "id"),
        "zero nproc": ({"id": "ok1", "entrypoint": "sleeper", "nproc": 0}, "nproc"),
        "nproc over max": ({"id": "ok1", "entrypoint": "sleeper", "nproc": 5}, "<= 4"),
        "unknown entrypoint": ({"id": "ok1", "entrypoint": "bash", "nproc": 1}, "allowed"),
        "too many args": ({"id": "ok1", "entrypoint": "sleeper", "nproc": 1, "args": ["x"] * 17},
                          "at most 16"),
        "arg too long": ({"id": "ok1", "entrypoint": "sleeper", "nproc": 1, "args": ["x" * 129]},
                         "at most 128"),
        "extra field": ({"id": "ok1", "entrypoint": "sleeper", "nproc": 1, "shell": "sh"}, "shell"),
    }  # fmt: skip
    for name, (body, needle) in cases.items():
        resp = httpx.post(daemon.url + "/api/v1/jobs", json=body, headers=daemon.auth)
        assert resp.status_code == 400, (name, resp.text)
        doc = resp.json()
        assert doc["status"] == 400 and needle in doc["error"], (name, doc)
    resp = httpx.post(
        daemon.url + "/api/v1/jobs", content=b"{not json", headers={**daemon.auth,
        "Content-Type": "application/json"},
    )  # fmt: skip
    assert resp.status_code == 400
    assert daemon.get("/api/v1/jobs/ok1").status_code == 404


def test_unknown_job_404_duplicate_409_and_cancel(daemon: Daemon) -> None:
    resp = daemon.get("/api/v1/jobs/nosuchjob")
    assert resp.status_code == 404 and "nosuchjob" in resp.json()["error"]
    resp = httpx.delete(daemon.url + "/api/v1/jobs/nosuchjob", headers=daemon.auth)
    assert resp.status_code == 404

    # Runs alongside: a job whose ranks exit with code 3 (checked at the end).
    assert daemon.submit("exit3", "sleeper", 2, ["0.5", "3"]).status_code == 201
    # A rank that ignores SIGTERM: the cancel must escalate to SIGKILL after the grace period.
    first = daemon.submit("dup", "sleeper", 2, ["60", "--ignore-term"])
    assert first.status_code == 201, first.text
    again = daemon.submit("dup", "sleeper", 1, ["1"])
    assert again.status_code == 409 and "already exists" in again.json()["error"]

    job = daemon.wait("dup", {"RUNNING"})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # both ranks up (they print once started)
        logs = [daemon.get("/api/v1/jobs/dup/logs", params={"rank": r, "stream": "stdout"})
                for r in (0, 1)]  # fmt: skip
        if all(r.status_code == 200 and "up" in r.text for r in logs):
            break
        time.sleep(0.25)
    else:
        raise AssertionError("ranks did not start")
    launcher = job["pid"]
    t0 = time.monotonic()
    resp = httpx.delete(daemon.url + "/api/v1/jobs/dup", headers=daemon.auth)
    assert resp.status_code == 202, resp.text
    job = daemon.wait("dup", {"CANCELLED", "FAILED", "COMPLETED", "LOST"}, timeout=60)
    took = time.monotonic() - t0
    assert job["state"] == "CANCELLED", job
    assert took >= 2.5, f"ended after {took:.1f}s, before the 3 s grace: SIGTERM was not ignored?"
    assert not _alive(launcher)
    for rank_pid in _rank_pids(daemon, "dup"):
        assert not _alive(rank_pid), f"rank pid {rank_pid} survived the cancel"
    resp = httpx.delete(daemon.url + "/api/v1/jobs/dup", headers=daemon.auth)
    assert resp.status_code == 409 and "already ended" in resp.json()["error"]

    job = daemon.wait("exit3", {"COMPLETED", "FAILED", "CANCELLED", "LOST"}, timeout=60)
    assert job["state"] == "FAILED", job
    assert 3 in {s["exit_code"] for s in job["ranks"].values()}, job["ranks"]
    assert job["first_failure"]["exit_code"] == 3
    assert "exit code 3" in job["reason"]


def _rank_pids(daemon: Daemon, job_id: str) -> list[int]:
    pids = []
    for r in (0, 1):
        params = {"rank": r, "stream": "stdout"}
        text = daemon.get(f"/api/v1/jobs/{job_id}/logs", params=params).text
        for word in text.split("pid ")[1:]:
            pids.append(int(word.split()[0]))
    assert len(pids) == 2, pids
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_registration_and_sd(daemon: Daemon) -> None:
    """A rank registers itself on the agent socket; its /sd entry goes when its process dies."""
    sock = daemon.state_dir / "agent.sock"
    wait_for_socket(sock)
    child = subprocess.Popen(
        [sys.executable, "-c", RANK, str(sock)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        port = int(child.stdout.readline())
        sd = daemon.get("/sd").json()
        assert sd == [{"targets": [f"127.0.0.1:{port}"], "labels": {
            "run": "r1", "rank": "3", "local_rank": "1", "node": "n", "job_id": "j9"}}]  # fmt: skip
        metrics = daemon.get("/metrics").text
        assert "ddpmon_daemon_registered_ranks 1.0" in metrics
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        assert daemon.get("/sd").json() == []  # died without deregistering
        bad = {"run": "a/b", "rank": 0, "port": port}
        status, doc = agent_call(sock, "POST", "/api/v1/ranks", bad)
        assert status == 400 and "run" in json.dumps(doc), doc
    finally:
        child.kill()
        child.wait(timeout=10)


# A rank as the agent is one: its own endpoint, registered through the agent's client.
RANK = """
import socket, sys, time
from ddpmon.export.registration import register_rank
srv = socket.create_server(("127.0.0.1", 0))
port = srv.getsockname()[1]
register_rank("unix:" + sys.argv[1], {"run": "r1", "rank": 3, "local_rank": 1, "node": "n",
              "port": port, "host": "127.0.0.1", "job_id": "j9", "unknown_key": 1})
print(port, flush=True)
time.sleep(60)
"""


def test_client_never_raises(daemon: Daemon) -> None:
    from ddpmon.export.registration import deregister_rank, register_rank

    info = {"run": "c1", "rank": "0", "local_rank": "0", "node": "n", "pid": os.getpid(),
            "port": 7470, "target": "127.0.0.1:7470", "job_id": ""}  # fmt: skip
    t0 = time.monotonic()
    register_rank(daemon.url, info)  # nothing listens on 7470: refused by the daemon, logged
    assert daemon.get("/sd").json() == []
    register_rank("http://127.0.0.1:1", info)  # nothing listens: logged, not raised
    register_rank(daemon.url, {**info, "pid": "x"})  # rejected by the daemon: logged
    register_rank("unix:/nonexistent/agent.sock", info)
    deregister_rank("http://127.0.0.1:1", info)
    deregister_rank(daemon.url, info)
    assert time.monotonic() - t0 < 10


def test_openapi_and_metrics(daemon: Daemon) -> None:
    spec = daemon.get("/openapi.json").json()
    assert {"/api/v1/jobs", "/api/v1/jobs/{job_id}", "/sd", "/metrics"} <= set(spec["paths"])
    post = spec["paths"]["/api/v1/jobs"]["post"]
    assert {"201", "400", "401", "409"} <= set(post["responses"]) and "422" not in post["responses"]
    text = daemon.get("/metrics").text
    assert 'ddpmon_collector_success{collector="host"} 1.0' in text
    assert 'ddpmon_collector_success{collector="nvml"}' in text
    assert 'ddpmon_daemon_jobs{state="RUNNING"}' in text


def test_jobs_cli(daemon: Daemon) -> None:
    env = {**os.environ, "COLUMNS": "200"}
    base = [sys.executable, "-m", "ddpmon.cli", "jobs", "--url", daemon.url,
            "--token-file", str(daemon.state_dir / "token")]  # fmt: skip

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*base, *args], capture_output=True, text=True, env=env, timeout=120)

    res = cli("submit", "cli1", "sleeper", "--nproc", "1", "--wait", "--", "0.2", "4")
    assert res.returncode == 1, res.stderr  # --wait: non-zero unless COMPLETED
    assert "cli1" in res.stdout and "FAILED" in res.stdout and "exit code 4" in res.stdout
    res = cli("status", "cli1")
    assert res.returncode == 0 and "first failure: rank 0" in res.stdout, res.stdout
    res = cli("list")
    assert res.returncode == 0 and "cli1" in res.stdout
    res = cli("--json", "status", "cli1")
    assert '"state": "FAILED"' in res.stdout
    res = cli("cancel", "cli1")
    assert res.returncode == 1 and "409" in res.stderr
    res = cli("status", "nope")
    assert res.returncode == 1 and "404" in res.stderr
    res = subprocess.run([*base[:-2], "--token-file", "/nonexistent", "cancel", "x"],
                         capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    assert res.returncode == 2 and "token" in res.stderr


def test_logs_never_follow_a_link_the_job_planted(daemon: Daemon) -> None:
    """A job owns its logs dir; a link it leaves there in place of a log must not make the API
    serve the file it points to (here the daemon's own token)."""
    assert daemon.submit("linky", "sleeper", 1, ["0.2"]).status_code == 201
    daemon.wait("linky", {"COMPLETED"})
    assert daemon.get("/api/v1/jobs/linky/logs", params={"stream": "stdout"}).status_code == 200
    job_dir = Path(daemon.job("linky")["job_dir"])
    (log,) = job_dir.glob("logs/*/attempt_*/0/stdout.log")
    log.unlink()
    log.symlink_to(daemon.state_dir / "token")
    resp = daemon.get("/api/v1/jobs/linky/logs", params={"stream": "stdout"})
    assert resp.status_code == 404 and daemon.token not in resp.text, resp.text
    assert "link" in resp.json()["error"]


def test_no_page_loads_code_from_a_cdn(daemon: Daemon) -> None:
    for path in ("/docs", "/redoc"):
        assert daemon.get(path).status_code == 404
    assert daemon.get("/openapi.json").status_code == 200
