"""Rank processes forked from a zygote that imported torch once (``zygote_server.py``).

A rank started as ``python worker.py`` spends about 2.7 s of CPU importing torch and ddpmon
before its first line runs; the suite starts hundreds, on two cores. Each pytest process keeps
one zygote (started at its first use, ended with the process) that has done those imports and
forks a child per rank: the child then has the command's argv, environment, working directory
and ``sys.path``, its own session, stdin on ``/dev/null`` and its output in files, and exits the
interpreter's normal way. ``run_group`` in ``ranks.py`` uses it for every ``python SCRIPT``
command; ``DDPMON_TEST_ZYGOTE=0`` turns it off (every rank a fresh interpreter, as before).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

SERVER = Path(__file__).with_name("zygote_server.py")


def enabled() -> bool:
    return os.environ.get("DDPMON_TEST_ZYGOTE", "1") != "0"


def forkable(cmd: list[str]) -> bool:
    """``python SCRIPT.py ...`` with this interpreter (not ``-m``, not another program)."""
    return len(cmd) >= 2 and cmd[0] == sys.executable and cmd[1].endswith(".py")


class Child:
    def __init__(self, zygote: Zygote, pid: int, out: Path, err: Path) -> None:
        self.zygote, self.pid, self._out, self._err = zygote, pid, out, err
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code, or None when ``timeout`` passed first."""
        if self.returncode is None:
            self.returncode = self.zygote.wait(self.pid, timeout)
        return self.returncode

    def output(self) -> tuple[str, str]:
        return (self._out.read_text(errors="replace"), self._err.read_text(errors="replace"))


class Zygote:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dir = Path(tempfile.mkdtemp(prefix="ddpmon-zygote-"))
        self._count = 0
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(SERVER.parents[2]), env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen(
            [sys.executable, str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=env, text=True, bufsize=1)
        ready = self._read()
        if not ready.get("ready"):
            raise RuntimeError(f"the zygote did not start: {ready}")

    def _read(self) -> dict:
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the zygote exited ({self._proc.poll()})")
        return json.loads(line)

    def _ask(self, request: dict) -> dict:
        with self._lock:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            return self._read()

    def spawn(self, cmd: list[str], env: dict[str, str], cwd: Path | None = None) -> Child:
        self._count += 1
        out = self._dir / f"{self._count}.out"
        err = self._dir / f"{self._count}.err"
        reply = self._ask({"op": "spawn", "argv": cmd, "env": env,
                           "cwd": str(cwd or os.getcwd()), "stdout": str(out),
                           "stderr": str(err)})
        return Child(self, reply["pid"], out, err)

    def wait(self, pid: int, timeout: float | None) -> int | None:
        reply = self._ask({"op": "wait", "pid": pid,
                           "timeout": 10 ** 9 if timeout is None else timeout})
        return None if reply.get("timeout") else int(reply["code"])

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()  # EOF: the zygote kills what still runs, then exits
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        shutil.rmtree(self._dir, ignore_errors=True)


_zygote: Zygote | None = None
_owner: int | None = None


def get() -> Zygote:
    """This process's zygote (a fork of the pytest process starts its own)."""
    global _zygote, _owner
    if _zygote is None or _owner != os.getpid():
        _zygote, _owner = Zygote(), os.getpid()
        atexit.register(_zygote.close)
    return _zygote
