"""The zygote of ``tests/support/zygote.py``: imports torch (and what rank workers import) once,
then forks a rank per request, each as ``python SCRIPT ARGS`` would run it.

Protocol: one JSON object per line on stdin, one answer per line on stdout.
- ``{"op": "spawn", "argv": [...], "env": {...}, "cwd": ..., "stdout": PATH, "stderr": PATH}``
  answers ``{"pid": N}``: the child has its own session, stdin ``/dev/null``, fds 1 and 2 on
  the two files, ``os.environ``, ``sys.argv``, ``sys.path`` and the working directory of a
  fresh interpreter started with that command, and exits through the interpreter's own exit
  (atexit handlers, stream flushes), with the script's code;
- ``{"op": "wait", "pid": N, "timeout": T}`` answers ``{"code": C}`` (negative: the signal
  that ended it, as ``Popen.returncode``) or ``{"timeout": true}``.
EOF on stdin: every child still running is killed and the zygote exits.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import runpy
import signal
import sys
import time

PRELOAD = (
    "torch", "torch.distributed", "torch.nn.parallel", "torch.distributed.device_mesh",
    "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
    "torch._dynamo", "ddpmon", "ddpmon.agent.monitor",
)


def serve() -> dict | None:
    """Answer requests; returns the request a forked child is to run (None in the zygote when
    its client is gone)."""
    children: set[int] = set()
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "spawn":
            # What the zygote holds (torch, ddpmon, ...) lives as long as the child does: frozen,
            # the child's garbage collections never walk it, nor copy its pages on the way. Its
            # exit walked all of it, 1.6 s of CPU for every rank before (0.4 s now).
            gc.freeze()
            pid = os.fork()
            if pid == 0:
                return request
            children.add(pid)
            _answer({"pid": pid})
        elif request["op"] == "wait":
            pid, deadline = request["pid"], time.monotonic() + float(request["timeout"])
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    children.discard(pid)
                    _answer({"code": os.waitstatus_to_exitcode(status)})
                    break
                if time.monotonic() > deadline:
                    _answer({"timeout": True})
                    break
                time.sleep(0.01)
    for pid in children:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return None


def _answer(reply: dict) -> None:
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


def become(request: dict) -> None:
    """In the forked child: turn into ``python SCRIPT ARGS`` with the request's environment."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.close(null)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdin
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    script, *_ = sys.argv[:] = request["argv"][1:]
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(os.path.abspath(script))] + extra + [
        p for p in sys.path[1:] if p not in extra]
    if request["env"].get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    threads = request["env"].get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        import torch

        torch.set_num_threads(int(threads))


def main() -> None:
    for name in PRELOAD:
        __import__(name)
    _answer({"ready": True})
    request = serve()
    if request is None:
        return
    become(request)
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
