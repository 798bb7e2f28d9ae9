"""Start a real ``ddpmon daemon`` (its CLI, in its own process group) for the security tests."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

from tests.support.ports import free_port

TOKEN = "t0ken-for-tests-0123456789abcdef"


def start_daemon(
    spawn, tmp_path: Path, name: str, *extra: str, bind: str = "127.0.0.1", existing: bool = False
):
    """The daemon on a free port of ``bind`` with a known token; returns (proc, port).
    ``existing``: the state dir is already there (a test prepared it)."""
    port = free_port(bind)
    state = tmp_path / f"{name}-state"
    state.mkdir(mode=0o700, exist_ok=existing)
    token = state / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    proc = spawn(
        [sys.executable, "-m", "ddpmon.cli", "daemon", "--bind", bind, "--port", str(port),
         "--state-dir", str(state), "--node", f"{name}-node", *extra],
        name,
    )
    end = time.monotonic() + 30
    while time.monotonic() < end:
        assert proc.poll() is None, proc.output_path.read_text()[-3000:]
        try:
            socket.create_connection((bind, port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"daemon {name} did not listen: {proc.output_path.read_text()[-3000:]}")
