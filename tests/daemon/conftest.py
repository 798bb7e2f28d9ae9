"""A real ``ddpmon daemon`` subprocess per test, on free loopback ports, with cleanup that
kills every process the daemon launched (jobs run in their own sessions)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from tests.support.ports import free_port, free_ports

HERE = Path(__file__).resolve().parent
SLEEPER = HERE / "sleeper.py"


@dataclass
class Daemon:
    state_dir: Path
    config_path: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path = field(init=False)
    launched: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.log_path = self.state_dir.parent / "daemon.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def token(self) -> str:
        return (self.state_dir / "token").read_text().strip()

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def start(self) -> None:
        argv = [
            sys.executable, "-m", "ddpmon.cli", "daemon", "--port", str(self.port),
            "--state-dir", str(self.state_dir), "--config", str(self.config_path),
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited: {self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError("daemon did not come up")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.remember_jobs()
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10, **kw)

    def submit(self, job_id: str, entrypoint: str, nproc: int, args: list[str], **kw: Any):
        body = {"id": job_id, "entrypoint": entrypoint, "nproc": nproc, "args": args}
        resp = httpx.post(
            self.url + "/api/v1/jobs", json=body, headers=kw.pop("headers", self.auth), timeout=10
        )
        self.remember_jobs()
        return resp

    def job(self, job_id: str) -> dict[str, Any]:
        resp = self.get(f"/api/v1/jobs/{job_id}")
        assert resp.status_code == 200, resp.text
        return resp.json()

    def wait(self, job_id: str, states: set[str], timeout: float = 90) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job["state"] in states:
                return job
            time.sleep(0.25)
        raise AssertionError(f"job {job_id} not in {states} after {timeout}s: {job}")

    def remember_jobs(self) -> None:
        try:
            for job in self.get("/api/v1/jobs").json()["jobs"]:
                if job.get("pid"):
                    self.launched.add(int(job["pid"]))
        except Exception:
            pass

    def kill_jobs(self) -> None:
        """Kill every launcher and all its descendants (workers run in their own sessions)."""
        for pid in self.launched:
            try:
                proc = psutil.Process(pid)
                family = [proc, *proc.children(recursive=True)]
            except psutil.Error:
                continue
            for p in family:
                try:
                    os.killpg(p.pid, signal.SIGKILL) if os.getpgid(p.pid) == p.pid else p.kill()
                except (OSError, psutil.Error):
                    pass
            psutil.wait_procs(family, timeout=5)


def write_config(path: Path, **overrides: Any) -> Path:
    lo = free_ports(40)  # ranks' /metrics come from this range
    hi = lo + 39
    cfg: dict[str, Any] = {
        "entrypoints": {
            "demo": {"module": "ddpmon.demo.train"},
            "sleeper": {  # sleeper.py SECONDS [EXIT_CODE] [--ignore-term]
                "script": str(SLEEPER),
                "positional": ["float", "int"],
                "params": {"--ignore-term": "flag"},
            },
        },
        "max_nproc": 4,
        "max_args": 16,
        "max_arg_length": 128,
        "port_range": [lo, hi],
        "cancel_grace_seconds": 3,
        "poll_seconds": 0.25,
    }
    cfg.update(overrides)
    path.write_text(yaml.safe_dump(cfg))
    return path


def _factory(base: Path) -> tuple[Any, list[Daemon]]:
    made: list[Daemon] = []

    def make(**overrides: Any) -> Daemon:
        d = Daemon(
            state_dir=base / "state",
            config_path=write_config(base / "daemon.yaml", **overrides),
            port=free_port(),
        )
        d.start()
        made.append(d)
        return d

    return make, made


def _cleanup(made: list[Daemon]) -> None:
    for d in made:
        d.stop()
        d.kill_jobs()


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Any]:
    make, made = _factory(tmp_path)
    yield make
    _cleanup(made)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon shared by a module's tests (start-up costs seconds on a busy 2-core box)."""
    make, made = _factory(tmp_path_factory.mktemp("daemon"))
    yield make()
    _cleanup(made)
