"""Helpers for forensics tests: Python subprocesses in their own process group, always reaped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


class Procs:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(
        self, code: str, *args: str, env: dict[str, str] | None = None, **kw
    ) -> subprocess.Popen:
        full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), *args],
            env=full_env,
            cwd=str(REPO),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            **kw,
        )
        self.procs.append(proc)
        return proc

    def run(self, code: str, *args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        proc = self.start(code, *args, **kw)
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.cleanup()
