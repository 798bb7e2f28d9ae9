"""Running an external server (Prometheus, Alertmanager) as a child process, on loopback.

Each server runs in its own process group, logs to a file, and is stopped with SIGTERM, then
SIGKILL, so nothing outlives ``stop()``. Used by ``ddpmon stack``, the live tests and the
dashboard benchmark.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import psutil


class StackError(RuntimeError):
    """A server is missing, failed to start or did not become ready; the message says which."""


def find_binary(*names: str) -> str:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
        if Path(f"/usr/bin/{name}").exists():
            return f"/usr/bin/{name}"
    raise StackError(
        f"{' or '.join(names)} not found; install Debian's prometheus and prometheus-alertmanager "
        "packages (`make debs`)"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ManagedProcess:
    """A server in its own process group, logging to a file; ``stop()`` always reaps it."""

    def __init__(self, name: str, cmd: list[str], log_path: Path) -> None:
        self.name, self.cmd, self.log_path = name, cmd, log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def wait_ready(self, url: str, timeout: float = 30.0) -> None:
        """Until ``url`` answers 200 *from this process*: a port probed free can be bound by
        another server before ours binds it, and that one answers too while ours is still on
        its way to "address already in use"."""
        deadline = time.monotonic() + timeout
        port = urllib.parse.urlsplit(url).port
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                code = self.proc.returncode
                raise StackError(f"{self.name} exited with {code}: {self.log_tail()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200 and self._listens_on(port):
                    return
            time.sleep(0.1)
        raise StackError(f"{self.name} not ready at {url} after {timeout:g}s: {self.log_tail()}")

    def _listens_on(self, port: int | None) -> bool:
        """This process (not another on the same port) listens on ``port``."""

        if self.proc is None or port is None:
            return True
        try:
            sockets = psutil.Process(self.proc.pid).net_connections(kind="inet")
        except psutil.Error:
            return False  # gone, or not readable yet: ask again
        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in sockets)

    def log_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, timeout: float = 10.0) -> int | None:
        proc = self.proc
        if proc is None:
            return None
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            if proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait)
        return proc.poll()


class ManagedServer:
    """Lifecycle shared by the Prometheus and Alertmanager wrappers (``_process`` set by start)."""

    _process: ManagedProcess | None = None

    def start(self, timeout: float = 30.0) -> ManagedServer:
        raise NotImplementedError

    def poll(self) -> int | None:
        """None while the server runs (or before start); its exit code once it has exited."""
        proc = self._process.proc if self._process else None
        return proc.poll() if proc is not None else None

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()

    def __enter__(self) -> ManagedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


