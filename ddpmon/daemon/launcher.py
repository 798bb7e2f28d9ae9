"""torchrun with a machine-readable result (``-m ddpmon.daemon.launcher --result F -- ARGS``).

``ARGS`` are torchrun's own arguments. This runs torchrun's ``run`` in-process and writes, on
exit, a JSON file with the outcome and each rank's exit code or signal (torchrun only prints
them). The daemon reads that file, which also works after a daemon restart, when the launcher
is no longer its child and its exit status cannot be collected.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ..rundir.atomic import write_json_atomic


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"SIG{num}"


def _rank_status(exitcode: int) -> dict[str, Any]:
    if exitcode < 0:
        return {"exit_code": None, "signal": -exitcode, "signal_name": _signal_name(-exitcode)}
    return {"exit_code": exitcode, "signal": None, "signal_name": None}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="ddpmon.daemon.launcher")
    parser.add_argument("--result", required=True, type=Path)
    if "--" not in argv:
        parser.error("expected '--' followed by torchrun arguments")
    split = argv.index("--")
    opts = parser.parse_args(argv[:split])
    torchrun_argv = argv[split + 1 :]

    from torch.distributed import run as torchrun  # torch-free start of the CLI and the daemon
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    targs = torchrun.parse_args(torchrun_argv)
    nproc = int(targs.nproc_per_node)
    doc: dict[str, Any] = {"started_at": time.time(), "pid": os.getpid(), "nproc": nproc}
    code = 0
    try:
        torchrun.run(targs)
        doc["outcome"] = "succeeded"
        doc["ranks"] = {str(r): _rank_status(0) for r in range(nproc)}
    except ChildFailedError as exc:
        code = 1
        doc["outcome"] = "failed"
        ranks: dict[str, dict[str, Any]] = {}
        failures = []
        for global_rank, failure in sorted(exc.failures.items()):
            status = _rank_status(int(failure.exitcode))
            status.update(pid=failure.pid, local_rank=failure.local_rank)
            ranks[str(global_rank)] = status
            failures.append(
                {
                    "rank": int(global_rank),
                    "ts": float(failure.timestamp),
                    "source": "torchrun",
                    "kind": "signal" if status["signal"] else "exit",
                    **{k: status[k] for k in ("exit_code", "signal", "signal_name", "pid")},
                    "message": str(failure.message)[:2000],
                }
            )
        for r in range(nproc):
            # Ranks still running when torchrun saw the failure are stopped by torchrun itself.
            ranks.setdefault(
                str(r),
                {
                    "exit_code": None,
                    "signal": None,
                    "signal_name": None,
                    "note": "stopped by torchrun after another rank failed",
                },
            )
        doc["ranks"], doc["failures"] = ranks, failures
    except SignalException as exc:
        sig = int(exc.sigval)
        code = 128 + sig
        doc["outcome"] = "signalled"
        doc["signal"], doc["signal_name"] = sig, _signal_name(sig)
        doc["ranks"] = {
            str(r): {
                "exit_code": None,
                "signal": sig,
                "signal_name": _signal_name(sig),
                "note": "torchrun forwarded the signal",
            }
            for r in range(nproc)
        }
    except BaseException as exc:  # launcher-level error (bad rendezvous, import error...)
        code = 2
        doc["outcome"] = "error"
        doc["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    doc["ended_at"] = time.time()
    doc["exit_code"] = code
    write_json_atomic(opts.result, doc)
    return code


if __name__ == "__main__":
    sys.exit(main())
