"""Slurm's own account of a run's job, for ``ddpmon timeline``: state, reason, exit code and
requeues, beside ddpmon's first failure.

The job id comes from the run's manifest (``slurm.job_id``, written by the agent under Slurm).
``sacct`` answers where Slurm keeps accounting, once the job's end has reached the database
(every run of a requeued job, and why each ended); ``scontrol show job`` otherwise, for as long
as the controller remembers the job (``MinJobAge``, 300 s by default). Best effort: no Slurm
command, no answer, or an answer that cannot be read gives None, never an error.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from ..job.slurm import ended
from ..rundir.safe_read import load_json

_JOB_ID = re.compile(r"^[0-9]+(_[0-9]+)?$")


def job_id_of(run_path: Path) -> str | None:
    """The Slurm job of a run, from its manifest (None outside Slurm or when unreadable)."""
    try:
        manifest = load_json(Path(run_path) / "manifest.json")
    except (OSError, ValueError):
        return None
    slurm = manifest.get("slurm") if isinstance(manifest, dict) else None
    job = slurm.get("run_id") if isinstance(slurm, dict) else None
    return job if isinstance(job, str) and _JOB_ID.match(job) else None


def query(job_id: str, timeout: float = 10.0) -> dict[str, Any] | None:
    """``{"job_id", "state", "reason", "exit_code", "restarts", "source"}`` or None."""
    if not _JOB_ID.match(job_id):
        return None
    accounted = _sacct(job_id, timeout)
    if accounted is not None and ended(accounted["state"]):
        return accounted
    # the database learns of a job's end a moment after the controller: while the controller
    # still remembers the job, its word is the newer one
    return _scontrol(job_id, timeout) or accounted


def _run(argv: list[str], timeout: float) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout if res.returncode == 0 else None


def _sacct(job_id: str, timeout: float) -> dict[str, Any] | None:
    # -D lists every run of a requeued job, oldest first: the last row is the job's end, the
    # earlier ones say why Slurm requeued it (NODE_FAIL, PREEMPTED, REQUEUED...)
    out = _run(["sacct", "-j", job_id, "-X", "-D", "-n", "-P", "-o",
                "JobID,State,ExitCode,Reason,NodeList"], timeout)
    rows = [line.split("|") for line in (out or "").splitlines() if line.count("|") == 4]
    if not rows:
        return None
    _, state, code, reason, nodes = rows[-1]
    earlier = [row[1] for row in rows[:-1]]
    # sacct's Reason is the last reason the job waited for: say it only while it waits
    waiting = not ended(state) and reason not in ("", "None")
    return {"job_id": job_id, "state": state, "reason": reason if waiting else None,
            "exit_code": code,
            "nodes": nodes, "restarts": len(earlier) or None, "requeued_after": earlier,
            "source": "sacct"}


def _scontrol(job_id: str, timeout: float) -> dict[str, Any] | None:
    out = _run(["scontrol", "show", "job", "-o", job_id], timeout)
    if not out:
        return None
    fields: dict[str, str] = {}
    for item in out.split():
        key, _, value = item.partition("=")
        fields.setdefault(key, value)
    if "JobState" not in fields:
        return None
    restarts = fields.get("Restarts")
    return {"job_id": job_id, "state": fields["JobState"],
            "reason": None if fields.get("Reason") in (None, "None") else fields["Reason"],
            "exit_code": fields.get("ExitCode"), "nodes": fields.get("NodeList"),
            "restarts": int(restarts) if restarts and restarts.isdigit() else None,
            "source": "scontrol"}


def line(outcome: dict[str, Any]) -> str:
    parts = [f"exit {outcome['exit_code']}"] if outcome.get("exit_code") else []
    if outcome.get("reason"):
        parts.insert(0, f"reason {outcome['reason']}")
    if outcome.get("restarts"):
        after = sorted(set(outcome.get("requeued_after") or []))
        parts.append(f"requeued {outcome['restarts']} time" + "s" * (outcome["restarts"] > 1)
                     + (f" after {', '.join(after)}" if after else ""))
    return (f"job {outcome['job_id']} {outcome['state']}"
            + (f" ({', '.join(parts)})" if parts else "") + f" [{outcome['source']}]")
