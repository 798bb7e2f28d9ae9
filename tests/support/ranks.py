"""The suite's one rank launcher: N real gloo ranks of a worker script on 127.0.0.1.

Each rank gets the env torchrun would give it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``), ``OMP_NUM_THREADS=1`` (two cores: one
thread a rank), ``PYTHONFAULTHANDLER=1`` (a rank killed by a signal leaves its stacks) and the
repository on ``PYTHONPATH`` (workers import ``tests.support``). Every rank runs in its own session
and its whole process group is killed on a timeout or a failure, so no rank outlives its test.

The master port is probed free outside the ephemeral range (``ports.free_port``), but another
process can still bind it before rank 0's store does; a launch whose ranks failed with
``EADDRINUSE`` is started again on a new port (at most ``retries`` times). Nothing else is retried.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import zygote
from .ports import free_port

REPO = Path(__file__).resolve().parents[2]
PORT_TAKEN = "EADDRINUSE"
LOST_PEER = ("Connection reset by peer", "Connection closed")


@dataclass
class RankOutput:
    code: int
    stdout: str
    stderr: str


def rank_env(rank: int, world: int, master_port: int, extra: dict[str, str] | None) -> dict:
    return dict(
        os.environ,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        OMP_NUM_THREADS="1",
        PYTHONFAULTHANDLER="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        **(extra or {}),
    )


def run_group(
    runs: list[tuple[list[str], dict[str, str]]], timeout: float, cwd: Path | None = None
) -> list[RankOutput]:
    """Start every ``(cmd, env)`` in its own session, wait for all (``timeout`` seconds each,
    then ``AssertionError``); every process group is killed when this returns. ``python
    SCRIPT`` commands are forked from the zygote (``zygote.py``), others started afresh."""
    procs = [_start(cmd, env, cwd) for cmd, env in runs]
    outputs: list[RankOutput] = []
    try:
        for proc in procs:
            try:
                code, stdout, stderr = proc.finish(timeout)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                _, stdout, stderr = proc.finish(None)
                raise AssertionError(
                    f"{runs[procs.index(proc)][0]} timed out after {timeout:g}s:\n"
                    f"{(stdout + stderr)[-4000:]}"
                ) from None
            outputs.append(RankOutput(code, stdout, stderr))
    finally:
        for proc in procs:
            kill_group(proc)
    return outputs


class _Process:
    """A ``Popen`` or a zygote ``Child``, finished alike."""

    def __init__(self, popen: subprocess.Popen | None = None, child: Any = None) -> None:
        self.popen, self.child = popen, child
        self.pid = popen.pid if popen is not None else child.pid

    def finish(self, timeout: float | None) -> tuple[int, str, str]:
        if self.popen is not None:
            out, err = self.popen.communicate(timeout=timeout)
            return (self.popen.returncode, out.decode(errors="replace"),
                    err.decode(errors="replace"))
        code = self.child.wait(timeout)
        if code is None:
            raise subprocess.TimeoutExpired("zygote child", timeout or 0)
        return (code, *self.child.output())

    def poll(self) -> int | None:
        if self.popen is not None:
            return self.popen.poll()
        return self.child.wait(0)


def _start(cmd: list[str], env: dict[str, str], cwd: Path | None) -> _Process:
    if zygote.enabled() and zygote.forkable(cmd):
        return _Process(child=zygote.get().spawn(cmd, env, cwd))
    return _Process(popen=subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True))


def kill_group(proc: subprocess.Popen | _Process) -> None:
    """SIGKILL ``proc``'s whole session (its children too: torchrun's ranks, a daemon's jobs)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if isinstance(proc, _Process) and proc.child is not None:
        proc.child.wait(None)
    elif proc.poll() is None:
        proc.wait()


def start_ranks(
    cmd: list[str], world: int, timeout: float, env: dict[str, str] | None
) -> list[RankOutput]:
    """Run ``cmd`` as ``world`` ranks once, on a fresh master port."""
    port = free_port()
    return run_group([(cmd, rank_env(r, world, port, env)) for r in range(world)], timeout)


def launch_ranks(
    script: Path | str,
    out: Path,
    args: list[str] | tuple[str, ...] = (),
    *,
    world: int = 2,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    retries: int = 2,
) -> list[RankOutput]:
    """Run ``python SCRIPT --out OUT ARGS`` as ``world`` ranks; raises ``AssertionError`` with
    every failed rank's output (the rank that failed first before those that lost a peer)."""
    cmd = [sys.executable, str(script), "--out", str(out), *args]
    for attempt in range(retries + 1):
        outputs = start_ranks(cmd, world, timeout, env)
        failed = [(r, o) for r, o in enumerate(outputs) if o.code != 0]
        if not failed:
            return outputs
        taken = any(PORT_TAKEN in o.stdout + o.stderr for _, o in failed)
        if not (taken and attempt < retries):
            break
    failed.sort(key=lambda f: any(s in f[1].stdout + f[1].stderr for s in LOST_PEER))
    raise AssertionError(
        "\n\n".join(
            f"rank {rank} exited {o.code}:\n{(o.stdout + o.stderr)[-3000:]}" for rank, o in failed
        )
    )


def run_ranks(
    script: Path | str,
    out: Path,
    args: list[str] | tuple[str, ...] = (),
    **kw,
) -> list[dict]:
    """``launch_ranks``, then each rank's ``OUT/rank<R>.json`` with its ``stderr`` added."""
    outputs = launch_ranks(script, out, args, **kw)
    results = []
    for rank, output in enumerate(outputs):
        data = json.loads((out / f"rank{rank}.json").read_text())
        data["stderr"] = output.stderr
        results.append(data)
    return results


def torchrun(script: Path | str, *args: str, nproc: int = 2) -> list[str]:
    """The command line of ``torchrun --standalone`` (its rendezvous picks its own port)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), str(script), *args]


def run_launcher(
    cmd: list[str] | Callable[[], list[str]],
    timeout: float,
    env: dict[str, str] | None = None,
    retries: int = 2,
    cwd: Path | None = None,
) -> RankOutput:
    """Run a command that starts the ranks itself (``torchrun(...)``, Lightning's launcher) with
    the rank env's defaults (one thread, faulthandler, the repository importable), in its own
    session with a hard timeout; stdout and stderr are returned apart. ``cmd`` may be a function
    that builds the command line on fresh ports: a run that failed with ``EADDRINUSE`` is then
    started again (at most ``retries`` times). ``cwd``: where it runs (default: the repository)."""
    base = {k: v for k, v in rank_env(0, 1, 0, env).items()
            if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                         "MASTER_ADDR", "MASTER_PORT")}
    base.pop("DDPMON_PORT", None)
    for attempt in range(retries + 1):
        argv = cmd() if callable(cmd) else cmd
        (output,) = run_group([(argv, base)], timeout, cwd=cwd or REPO)
        taken = output.code != 0 and PORT_TAKEN in output.stdout + output.stderr
        if not (taken and callable(cmd) and attempt < retries):
            return output
    raise AssertionError("unreachable")
