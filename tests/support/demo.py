"""Launch ``ddpmon demo`` (torchrun, gloo, 2 CPU ranks) for live tests and always clean it up.

torchrun starts every worker in its own session, so killing one process group is not enough.
``DemoRun.stop()`` interrupts the demo (which stops torchrun, which stops the ranks), then kills
whatever is left among the processes it saw descend from the demo and any process whose command
line names this run's unique run directory: only processes this test started.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.support.ports import free_port_pair


@dataclass
class DemoRun:
    """One ``ddpmon demo`` run in ``workdir``; use as a context manager.

    ``injects`` are demo fault specs (``nan@rank1:step20``, ``kill@rank1:step60`` ...).
    Ranks bind 127.0.0.1 and publish file_sd targets into ``sd_dir``.
    """

    workdir: Path
    sd_dir: Path
    steps: int
    step_delay: float
    injects: list[str] = field(default_factory=list)
    run_id: str = "live"
    nproc: int = 2
    env: dict[str, str] = field(default_factory=dict)
    linger: float | None = None
    """The ranks' linger_seconds (``ddpmon demo --linger``); None: the demo's default."""
    extra: list[str] = field(default_factory=list)
    """More ``ddpmon demo`` options (``--checkpoint-every 8`` ...)."""

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        self.run_dir = self.workdir / "runs"
        self.base_port = free_port_pair()
        self.log_path = self.workdir / f"demo-{self.run_id}.log"
        self.proc: subprocess.Popen | None = None
        self.started_at: float | None = None
        self._seen: dict[int, psutil.Process] = {}

    @property
    def ports(self) -> list[int]:
        return [self.base_port + r for r in range(self.nproc)]

    @property
    def run_path(self) -> Path:
        return self.run_dir / self.run_id

    def command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "ddpmon.cli",
            "demo",
            "--nproc",
            str(self.nproc),
            "--steps",
            str(self.steps),
            "--step-delay",
            str(self.step_delay),
            "--port",
            str(self.base_port),
            "--run-dir",
            str(self.run_dir),
            "--run-id",
            self.run_id,
            "--sd-dir",
            str(self.sd_dir),
            "--no-progress",
        ]
        for spec in self.injects:
            cmd += ["--inject", spec]
        if self.linger is not None:
            cmd += ["--linger", str(self.linger)]
        return cmd + list(self.extra)

    def start(self) -> DemoRun:
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, DDPMON_BIND="127.0.0.1", PYTHONUNBUFFERED="1", **self.env)
        self.started_at = time.time()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        return self

    def track(self) -> list[psutil.Process]:
        """Remember the demo's current descendants (call while it runs; cheap)."""
        if self.proc is None:
            return []
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self._seen.setdefault(child.pid, child)
        return list(self._seen.values())

    def rank_pids(self) -> dict[int, int]:
        """``{rank: pid}`` of the live rank processes, from their environment."""
        out = {}
        for proc in self.track():
            with contextlib.suppress(psutil.Error):
                rank = proc.environ().get("RANK")
                if rank is not None and proc.is_running():
                    out[int(rank)] = proc.pid
        return out

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.track()
            time.sleep(0.2)
        if self.proc.poll() is None:
            raise TimeoutError(f"demo still running after {timeout:g}s: {self.log_tail()}")
        return self.proc.returncode

    def events(self, rank: int) -> list[dict]:
        """The rank's event log (``events.rank<R>.jsonl``), parsed."""
        path = self.run_path / f"events.rank{rank}.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
        return out

    def progress_step(self, rank: int) -> int | None:
        """The last step ``rank`` completed, from its progress file (None before the first)."""
        from ddpmon.recorder.eventlog import progress_path, read_progress

        found = read_progress(progress_path(self.run_path, rank))
        return None if found is None else found["step"]

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self) -> None:
        """Stop the demo and every process it started; never raises, never leaves one behind."""
        if self.proc is None:
            return
        self.track()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)  # the demo stops torchrun on Ctrl-C
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=15)
        marker = str(self.run_dir)
        leftovers = list(self._seen.values())
        for proc in psutil.process_iter(["pid", "cmdline"]):
            with contextlib.suppress(psutil.Error):
                if marker in " ".join(proc.info["cmdline"] or []):
                    leftovers.append(proc)
        if self.proc.poll() is None:
            leftovers.append(psutil.Process(self.proc.pid))
        for proc in leftovers:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs([p for p in leftovers if _alive(p)], timeout=5)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)

    def __enter__(self) -> DemoRun:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _alive(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    return False
