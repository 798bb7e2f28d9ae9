"""``ddpmon daemon --backend slurm``: the job gateway submits each job to Slurm.

A job is one ``sbatch`` job on one node (``--nodes=1 --ntasks=1``, plus the config's
``slurm_args``, e.g. a partition) whose script runs exactly what the local backend runs:
``ddpmon.daemon.launcher`` around torchrun with the entry point and the checked arguments. The
same allow-list, parameter checks and token apply, and no shell ever sees a request's value:
the script is written by the daemon with every argument quoted (``shlex.quote``). The job's
directory (logs, ``result.json``) and run dir must be on a file system the node shares with the
daemon's host, as Slurm clusters have.

Followed with ``scontrol show job`` while it runs (state, reason, batch host), and ended from
``sacct`` where Slurm keeps accounting (``scontrol`` otherwise); the ranks' summary is scraped on
the node's address. Cancel is ``scancel``; a daemon restart re-adopts every job
Slurm still has, and one Slurm has forgotten ends from its ``result.json``.
"""

from __future__ import annotations

import logging
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from shutil import which

from ddpmon.forensics import slurm_outcome

from ..job.slurm import ENDED, ended
from .jobs import JobError, JobManager, JobStateConflict
from .store import JobRecord

log = logging.getLogger("ddpmon.daemon.slurm")



def scontrol_job(slurm_id: str, timeout: float = 10.0) -> dict[str, str] | None:
    """``scontrol show job -o``'s fields, or None when Slurm does not know the job (any more)."""
    try:
        res = subprocess.run(["scontrol", "show", "job", "-o", slurm_id], capture_output=True,
                             text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("scontrol show job %s: %s", slurm_id, exc)
        return None
    if res.returncode != 0:
        return None
    fields: dict[str, str] = {}
    for item in res.stdout.split():
        key, _, value = item.partition("=")
        fields.setdefault(key, value)
    return fields if "JobState" in fields else None


def node_address(node: str, timeout: float = 10.0) -> str | None:
    """A node's ``NodeAddr`` (where its ranks listen), from ``scontrol show node``."""
    try:
        res = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True,
                             text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    for item in res.stdout.split():
        key, _, value = item.partition("=")
        if key == "NodeAddr" and value:
            return value
    return None


@dataclass(slots=True)
class _SlurmHandle:
    job_id: str
    slurm_id: str
    host: str | None = None
    cancelled: bool = False


class SlurmJobManager(JobManager):
    backend = "slurm"

    def _launch(self, job: JobRecord) -> None:
        job_dir = Path(job.job_dir)
        try:
            launcher = self._prepare(job)
            script = job_dir / "slurm-job.sh"
            script.write_text(
                "#!/bin/sh\n# written by ddpmon daemon --backend slurm; every value quoted\n"
                'DDPMON_BIND="$(hostname -i | cut -d" " -f1)"; export DDPMON_BIND\n'
                f"exec {shlex.join(launcher)}\n"
            )
            script.chmod(0o700)
            env = {k: v for k, v in self._environment(job).items() if k != "DDPMON_BIND"}
            res = subprocess.run(
                ["sbatch", "--parsable", f"--job-name=ddpmon-{job.id}", "--nodes=1",
                 "--ntasks=1", f"--output={job_dir / 'slurm-%j.out'}", f"--chdir={job_dir}",
                 "--export=ALL", *self.settings.slurm_args, str(script)],
                capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL,
            )
            if res.returncode != 0:
                raise JobError(f"sbatch: {res.stderr.strip()[:500]}")
            slurm_id = res.stdout.strip().split(";")[0]
            if not slurm_id.isdigit():
                raise JobError(f"sbatch answered {res.stdout.strip()[:100]!r}, not a job id")
        except (OSError, JobError, subprocess.SubprocessError) as exc:
            job.state, job.reason, job.ended_at = "FAILED", f"launch failed: {exc}", time.time()
            self.store.save_job(job)
            log.warning("job %s: %s", job.id, job.reason)
            return
        job.slurm_job_id = slurm_id
        job.started_at = time.time()
        job.state, job.reason = "RUNNING", "submitted to Slurm"
        self.store.save_job(job)
        self._active[job.id] = _SlurmHandle(job.id, slurm_id)
        log.info("job %s submitted: Slurm job %s, ports %s", job.id, slurm_id, job.ports)

    def _allocate_ports(self, nproc: int) -> list[int]:
        """A block no running job holds: the ranks run on a node, not here, so this host's
        free ports say nothing about theirs."""
        lo, hi = self.settings.port_range
        taken = {p for j in self.store.list_jobs(("RUNNING",)) for p in j.ports}
        for base in range(lo, hi - nproc + 2):
            ports = list(range(base, base + nproc))
            if not taken.intersection(ports):
                return ports
        raise JobError(f"no {nproc} consecutive free ports in port_range {lo}-{hi}")

    def _recover_one(self, job: JobRecord) -> None:
        if job.slurm_job_id:
            with self._lock:
                self._active[job.id] = _SlurmHandle(job.id, job.slurm_job_id)
            log.info("re-adopted job %s (Slurm job %s)", job.id, job.slurm_job_id)
        else:
            self._finish(job, None, gone_while_down=True)

    def cancel(self, job_id: str) -> JobRecord:
        with self._lock:
            job = self.get(job_id)
            if job.final:
                raise JobStateConflict(f"job {job_id} already ended ({job.state})")
            if job.cancel_requested_at is None:
                job.cancel_requested_at = time.time()
                if job.state == "PENDING":
                    job.state, job.ended_at, job.reason = (
                        "CANCELLED", time.time(), "cancelled before start")
                self.store.save_job(job)
            handle = self._active.get(job_id)
        if handle is not None and not handle.cancelled:
            handle.cancelled = True
            self._scancel(handle.slurm_id)
        return self.get(job_id)

    @staticmethod
    def _scancel(slurm_id: str) -> None:
        try:
            subprocess.run(["scancel", slurm_id], capture_output=True, timeout=30,
                           stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("scancel %s: %s", slurm_id, exc)

    def _poll_job(self, handle: _SlurmHandle) -> None:  # type: ignore[override]
        job = self.store.get_job(handle.job_id)
        if job is None:
            return
        info = scontrol_job(handle.slurm_id)
        state = info.get("JobState") if info else None
        if info is not None and state not in ENDED:
            if state == "RUNNING":
                if handle.host is None and info.get("BatchHost"):
                    handle.host = node_address(info["BatchHost"]) or info["BatchHost"]
                if handle.host:
                    self._summarize(job.id, handle.host, job.ports)
            reason = f"Slurm job {handle.slurm_id}: {state}" + (
                f" ({info['Reason']})" if info.get("Reason") not in (None, "None") else "")
            with self._lock:
                current = self.store.get_job(job.id)
                if current is not None and not current.final and current.reason != reason:
                    current.reason = reason
                    self.store.save_job(current)
            return
        state, exit_code, why = _final(handle.slurm_id, info)
        code = int(exit_code.split(":")[0]) if exit_code and exit_code[0].isdigit() else None
        with self._lock:
            self._active.pop(handle.job_id, None)
            fresh = self.store.get_job(handle.job_id)
            if fresh is None:
                return
            self._finish(fresh, code)
            if state in ENDED and state != "COMPLETED" and fresh.cancel_requested_at is None:
                fresh = self.store.get_job(handle.job_id) or fresh
                fresh.reason = f"Slurm: {state}" + (f" ({why})" if why else "") + (
                    f"; {fresh.reason}" if fresh.reason else "")
                self.store.save_job(fresh)


def _final(slurm_id: str, info: dict[str, str] | None) -> tuple[str | None, str | None,
                                                                str | None]:
    """How an ended (or forgotten) job ended: state, ``ExitCode`` and reason.

    Accounting (``sacct``) first: it outlives ``MinJobAge``, so a daemon restarted long after
    the job still learns its state. ``scontrol``'s answer where no accounting runs, or where
    the job's end has not reached the database yet.
    """

    outcome = slurm_outcome.query(slurm_id)
    if outcome is not None and ended(outcome["state"]):
        return outcome["state"].split(" ")[0], outcome["exit_code"], outcome["reason"]
    if info is None:
        return None, None, None
    reason = info.get("Reason")
    return (info.get("JobState"), info.get("ExitCode"),
            None if reason in (None, "None") else reason)


def check_available() -> str | None:
    """Why the Slurm backend cannot run here (None: it can)."""

    missing = [c for c in ("sbatch", "scontrol", "scancel") if which(c) is None]
    if missing:
        return f"--backend slurm needs the Slurm client commands ({', '.join(missing)} missing)"
    return None
