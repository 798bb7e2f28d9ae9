"""Launch real gloo ranks on 127.0.0.1 for the parallel tests; a module's tests share launches.
Every rank is killed on timeout or failure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.ports import free_ports

WORKER = Path(__file__).with_name("_worker.py")
REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 150
_PORT_TAKEN = "EADDRINUSE"


def _free_port() -> int:
    return free_ports(1)


def launch(
    strategy: str,
    ranks: int,
    out: Path,
    *,
    args: tuple[str, ...] = (),
    worker: Path = WORKER,
    retries: int = 2,
) -> list[dict]:
    """Run ``worker`` on ``ranks`` gloo ranks; returns each rank's ``rank<R>.json`` from ``out``."""
    port = _free_port()
    procs = []
    for rank in range(ranks):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(ranks),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONFAULTHANDLER="1",  # a rank killed by a signal leaves its Python stacks
            PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        )
        cmd = [sys.executable, str(worker), "--out", str(out), *args]
        if strategy:
            cmd += ["--strategy", strategy]
        procs.append(
            subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    logs = []
    try:
        for proc in procs:
            stdout, _ = proc.communicate(timeout=TIMEOUT_S)
            logs.append(stdout.decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    failed = [(r, p.returncode, log) for r, (p, log) in enumerate(zip(procs, logs, strict=True))]
    failed = [f for f in failed if f[1] != 0]
    if failed and retries > 0 and any(_PORT_TAKEN in log for _, _, log in failed):
        # another process took the free port between our probe and the store's bind
        return launch(strategy, ranks, out, args=args, worker=worker, retries=retries - 1)
    if failed:
        # A rank that died first leaves its peers with "Connection reset by peer": show every
        # failed rank, the one that did not merely lose a peer first.
        failed.sort(key=lambda f: "Connection reset by peer" in f[2] or "Connection closed" in f[2])
        raise AssertionError(
            "\n\n".join(f"rank {rank} exited {code}:\n{log[-3000:]}" for rank, code, log in failed)
        )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
