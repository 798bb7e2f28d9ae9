"""Start N real ranks of a worker script (gloo on 127.0.0.1) and collect what they wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .demo import free_port


def run_ranks(
    script: Path,
    out: Path,
    args: list[str],
    *,
    world: int = 2,
    timeout: float = 240,
    env: dict[str, str] | None = None,
) -> list[dict]:
    """Run ``script --out OUT ARGS`` as ``world`` ranks; each writes ``OUT/rank<R>.json``.
    Returns those dicts (plus ``stderr``); every process is gone when this returns."""
    master = free_port()
    procs = []
    for rank in range(world):
        penv = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(master),
            OMP_NUM_THREADS="1",
            **(env or {}),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), "--out", str(out), *args],
                env=penv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        )
    streams = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            streams.append((stdout.decode(errors="replace"), stderr.decode(errors="replace")))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for rank, (proc, (stdout, stderr)) in enumerate(zip(procs, streams, strict=True)):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{stdout}\n{stderr}"
        data = json.loads((out / f"rank{rank}.json").read_text())
        data["stderr"] = stderr
        results.append(data)
    return results
