"""Launching and tracking jobs: torchrun (through ``ddpmon.daemon.launcher``) in its own session.

Each job gets a directory under the state dir with the launcher's output, torchrun's per-rank
logs (``logs/.../attempt_0/<local_rank>/{stdout,stderr}.log``) and ``result.json``. The ranks
get the agent's environment (run id = job id, run dir, a per-job port range, the daemon URL) so
they serve /metrics on known ports, write their event logs where the daemon looks, and register
for discovery. One watcher thread polls every job, escalates cancels, records outcomes and
launches PENDING jobs; it never waits on a rank's endpoint: each running job's summary is
scraped on a small pool (``ddpmon-scrape``), one scrape in flight per job, each rank's within a
total deadline, so an endpoint that trickles its answer delays only that job's summary. No shell
is involved: every command is an argv list.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from . import outcome, summary
from .params import ParamError, inside
from .processes import JobProcesses, process_start_time, same_process
from .processes import free_port as _free_port
from .processes import port_free as _port_free
from .settings import DaemonSettings
from .store import DuplicateJobError, JobRecord, Store

log = logging.getLogger("ddpmon.daemon.jobs")

__all__ = ["DuplicateJobError", "JobError", "JobManager", "JobNotFound", "JobStateConflict"]


class JobError(ValueError):
    """Invalid request (unknown entry point, limits)."""


class JobNotFound(KeyError):
    pass


class JobStateConflict(RuntimeError):
    """The request does not fit the job's state (e.g. cancel a finished job)."""


class JobManager:
    def __init__(
        self,
        store: Store,
        settings: DaemonSettings,
        state_dir: str | Path,
        *,
        daemon_url: str | None = None,
        agent_socket: str | None = None,
        python: str = sys.executable,
    ) -> None:
        self.store = store
        self.settings = settings
        self.state_dir = Path(state_dir)
        self.daemon_url = daemon_url
        self.agent_socket = agent_socket
        self.python = python
        self.run_dir = self.state_dir / "runs"
        self._lock = threading.RLock()
        self._active: dict[str, JobProcesses] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._scrapes = ThreadPoolExecutor(
            max_workers=min(8, max(2, settings.max_running_jobs)),
            thread_name_prefix="ddpmon-scrape",
        )
        self._scraping: set[str] = set()
        """Jobs whose summary scrape is in flight (at most one each)."""

    # lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Re-adopt or mark LOST what was running before a restart, then start the watcher."""
        self.recover()
        self._thread = threading.Thread(target=self._watch, name="ddpmon-jobs", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop watching. Jobs keep running; the next daemon start re-adopts them."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._scrapes.shutdown(wait=False, cancel_futures=True)

    def recover(self) -> None:
        """Never raises for one job: a job whose files cannot be read ends FAILED with the
        reason, and the daemon starts."""
        for job in self.store.list_jobs(("RUNNING",)):
            try:
                self._recover_one(job)
            except Exception as exc:
                log.exception("job %s could not be recovered", job.id)
                self._fail_unreadable(job, exc)

    def _recover_one(self, job: JobRecord) -> None:
        if same_process(job.pid, job.pid_create_time):
            assert job.pid is not None
            handle = JobProcesses(job.id, proc=psutil.Process(job.pid))
            handle.remember_descendants()
            with self._lock:
                self._active[job.id] = handle
            log.info("re-adopted job %s (pid %s)", job.id, job.pid)
        else:
            # The launcher is gone; its result file may still say how it ended.
            self._finish(job, None, gone_while_down=True)

    # API operations --------------------------------------------------------------------
    def validate(
        self, entrypoint: str, nproc: int, args: list[str], job_dir: Path | None = None
    ) -> list[str]:
        """Check a request; returns its ``args`` as the job gets them (``params.py``: declared
        options only, paths confined to ``job_dir``)."""
        s = self.settings
        if entrypoint not in s.entrypoints:
            allowed = ", ".join(sorted(s.entrypoints)) or "(none configured)"
            raise JobError(f"unknown entrypoint {entrypoint!r}; allowed: {allowed}")
        if not 1 <= nproc <= s.max_nproc:
            raise JobError(f"nproc={nproc}: expected 1 <= nproc <= {s.max_nproc}")
        if len(args) > s.max_args:
            raise JobError(f"{len(args)} arguments: at most {s.max_args} allowed")
        for i, arg in enumerate(args):
            if len(arg) > s.max_arg_length:
                raise JobError(f"args[{i}] is {len(arg)} characters: at most {s.max_arg_length}")
            if "\x00" in arg:
                raise JobError(f"args[{i}] contains a NUL character")
        try:
            return s.entrypoints[entrypoint].check_args(args, job_dir)
        except ParamError as exc:
            raise JobError(str(exc)) from None

    def submit(self, job_id: str, entrypoint: str, nproc: int, args: list[str]) -> JobRecord:
        job_dir = self.state_dir / "jobs" / job_id
        checked = self.validate(entrypoint, nproc, args, job_dir)
        job = JobRecord(id=job_id, entrypoint=entrypoint, nproc=nproc, args=checked)
        job.job_dir = str(job_dir)
        job.run_dir = str(self.run_dir)
        self.store.insert_job(job)  # raises DuplicateJobError
        self._schedule()
        return self.get(job_id)

    def get(self, job_id: str) -> JobRecord:
        job = self.store.get_job(job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    def list_jobs(self) -> list[JobRecord]:
        return self.store.list_jobs()

    def cancel(self, job_id: str) -> JobRecord:
        with self._lock:
            job = self.get(job_id)
            if job.final:
                raise JobStateConflict(f"job {job_id} already ended ({job.state})")
            if job.cancel_requested_at is not None:
                return job
            job.cancel_requested_at = time.time()
            if job.state == "PENDING":
                job.state, job.ended_at, job.reason = (
                    "CANCELLED",
                    time.time(),
                    "cancelled before start",
                )
                self.store.save_job(job)
                return job
            self.store.save_job(job)
            handle = self._active.get(job_id)
            if handle is not None:
                handle.terminate()
            return job

    # launching -------------------------------------------------------------------------
    def _schedule(self) -> None:
        with self._lock:
            running = len(self._active)
            for job in self.store.list_jobs(("PENDING",)):
                if running >= self.settings.max_running_jobs:
                    break
                self._launch(job)
                running += 1

    def _allocate_ports(self, nproc: int) -> list[int]:
        lo, hi = self.settings.port_range
        taken = {p for j in self.store.list_jobs(("RUNNING",)) for p in j.ports}
        host = self.settings.job_bind
        base = lo
        while base + nproc - 1 <= hi:
            ports = list(range(base, base + nproc))
            clash = next((p for p in ports if p in taken or not _port_free(host, p)), None)
            if clash is None:
                return ports
            base = clash + 1
        raise JobError(f"no {nproc} consecutive free ports in port_range {lo}-{hi}")

    def _prepare(self, job: JobRecord) -> list[str]:
        """Ports, the job dir (links checked) and the launcher's argv: the launcher around
        torchrun with the entry point and the checked arguments (both backends run this)."""
        entry = self.settings.entrypoints.get(job.entrypoint)
        if entry is None:
            raise JobError(f"entrypoint {job.entrypoint!r} is no longer configured")
        job_dir = Path(job.job_dir)
        job.ports = self._allocate_ports(job.nproc)
        job_dir.mkdir(parents=True, exist_ok=True)
        self._check_confined(job, job_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        return [
            self.python, "-m", "ddpmon.daemon.launcher",
            "--result", str(job_dir / "result.json"), "--",
            "--nnodes", "1", "--nproc-per-node", str(job.nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
            "--max-restarts", "0", "--rdzv-id", job.id,
            "--log-dir", str(job_dir / "logs"), "--redirects", "3", "--tee", "3",
            *self.settings.torchrun_args, *entry.argv(), *job.args,
        ]  # fmt: skip

    def _launch(self, job: JobRecord) -> None:
        job_dir = Path(job.job_dir)
        try:
            argv = self._prepare(job)
            env = self._environment(job)
            with open(job_dir / "launcher.log", "ab") as out:
                popen = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=str(job_dir),
                    start_new_session=True,
                    close_fds=True,
                )
        except (OSError, JobError) as exc:
            job.state, job.reason, job.ended_at = "FAILED", f"launch failed: {exc}", time.time()
            self.store.save_job(job)
            log.warning("job %s: %s", job.id, job.reason)
            return
        job.pid = popen.pid
        job.pid_create_time = process_start_time(popen.pid)
        job.started_at = time.time()
        job.state = "RUNNING"
        self.store.save_job(job)
        self._active[job.id] = JobProcesses(job.id, popen=popen)
        log.info("job %s started: pid %s, ports %s", job.id, popen.pid, job.ports)

    def _check_confined(self, job: JobRecord, job_dir: Path) -> None:
        """A path argument (made absolute inside the job dir at submit) must still lead inside
        it now that the directory exists: no symlink planted on the way leads out."""
        for i, arg in enumerate(job.args):
            if arg.startswith(str(job_dir) + os.sep) and not inside(arg, job_dir):
                raise JobError(f"args[{i}] leads out of the job directory through a link")

    def _environment(self, job: JobRecord) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPMON_", "PET_"))}
        env.update(
            DDPMON_RUN_ID=job.id,
            DDPMON_JOB_ID=job.id,
            DDPMON_RUN_DIR=str(self.run_dir),
            DDPMON_PORT=str(job.ports[0]),
            DDPMON_BIND=self.settings.job_bind,
            PYTHONUNBUFFERED="1",
        )
        if self.daemon_url:
            env["DDPMON_DAEMON_URL"] = self.daemon_url
        if self.agent_socket:
            env["DDPMON_DAEMON_SOCKET"] = self.agent_socket
        return env

    # watching --------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(self.settings.poll_seconds):
            try:
                self.poll_once()
            except Exception:  # keep watching; one bad record must not stop the others
                log.exception("job watcher iteration failed")

    def poll_once(self) -> None:
        with self._lock:
            handles = list(self._active.values())
        for handle in handles:
            try:
                self._poll_job(handle)
            except Exception:  # one job's damaged files or ranks never stop the others
                log.exception("job %s: poll failed", handle.job_id)
        self._schedule()

    def _poll_job(self, handle: JobProcesses) -> None:
        job = self.store.get_job(handle.job_id)
        if job is None:
            return
        done, code = handle.returncode()
        if not done:
            handle.remember_descendants()
            self._escalate(job, handle)
            bind = self.settings.job_bind
            self._summarize(job.id, "127.0.0.1" if bind in ("0.0.0.0", "::", "") else bind,
                            job.ports)
            return
        handle.reap_leftovers()
        with self._lock:
            self._active.pop(handle.job_id, None)
            fresh = self.store.get_job(handle.job_id)
            if fresh is not None:
                self._finish(fresh, code)

    def _summarize(self, job_id: str, host: str, ports: list[int]) -> None:
        """Scrape ``job_id``'s ranks on the pool, unless its previous scrape is still going:
        the watcher goes on at once, whatever the endpoints do."""
        with self._lock:
            if job_id in self._scraping or self._stop.is_set():
                return
            self._scraping.add(job_id)
        try:
            self._scrapes.submit(self._scrape_summary, job_id, host, ports)
        except RuntimeError:  # the pool was shut down (daemon stopping)
            with self._lock:
                self._scraping.discard(job_id)

    def scrapes_settled(self, timeout: float) -> bool:
        """Wait until no summary scrape is in flight (a caller that polled once and reads the
        summary back); False if one still runs after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                if not self._scraping:
                    return True
            time.sleep(0.01)
        return False

    def _scrape_summary(self, job_id: str, host: str, ports: list[int]) -> None:
        try:
            job = self.store.get_job(job_id)
            if job is None or job.final:
                return
            merged = summary.merge(job.summary, host, ports,
                                   client=self.settings.scrape_client())
            with self._lock:  # the watcher records a job's end under the same lock
                current = self.store.get_job(job_id)
                if current is not None and not current.final:
                    current.summary = merged
                    self.store.save_job(current)
        except Exception:  # a scrape never stops the next one
            log.exception("job %s: summary scrape failed", job_id)
        finally:
            with self._lock:
                self._scraping.discard(job_id)

    def _escalate(self, job: JobRecord, handle: JobProcesses) -> None:
        if job.cancel_requested_at is None or handle.killed:
            return
        if time.time() - job.cancel_requested_at >= self.settings.cancel_grace_seconds:
            handle.killed = True
            log.warning("job %s: grace period over, SIGKILL", job.id)
            handle.kill_all()

    def _finish(self, job: JobRecord, code: int | None, gone_while_down: bool = False) -> None:
        """Record how ``job`` ended. Never raises: a job's files are the job's, so a damaged or
        hostile one ends the record FAILED with the reason, never RUNNING for ever."""
        try:
            self._finish_from_files(job, code, gone_while_down)
        except Exception as exc:
            log.exception("job %s: its result could not be read", job.id)
            self._fail_unreadable(job, exc)

    def _fail_unreadable(self, job: JobRecord, exc: BaseException) -> None:
        job.state = "CANCELLED" if job.cancel_requested_at is not None else "FAILED"
        job.reason = f"its result files could not be read ({type(exc).__name__})"
        job.ended_at = job.ended_at or time.time()
        self.store.save_job(job)

    def _finish_from_files(self, job: JobRecord, code: int | None, gone_while_down: bool) -> None:
        job_dir = Path(job.job_dir)
        result = outcome.read_result(job_dir / "result.json")
        failures = list((result or {}).get("failures", []))
        failures += outcome.event_failures(Path(job.run_dir) / job.id)
        job.failures = failures
        job.first_failure = outcome.first_failure(failures)
        job.ranks = dict((result or {}).get("ranks", {}))
        job.exit_code = (result or {}).get("exit_code", code)
        job.ended_at = (result or {}).get("ended_at") or time.time()
        if job.run_dir:
            job.summary = summary.merge_final(job.summary, Path(job.run_dir) / job.id)
            job.verdict = outcome.run_verdict(Path(job.run_dir) / job.id)
        if job.cancel_requested_at is not None:
            job.state, job.reason = "CANCELLED", "cancelled by request"
        elif result is not None:
            if result.get("outcome") == "succeeded":
                job.state, job.reason = "COMPLETED", None
            else:
                job.state = "FAILED"
                job.reason = _failure_reason(result, job.first_failure)
        elif gone_while_down:
            job.state = "LOST"
            job.reason = (
                f"launcher pid {job.pid} ended while the daemon was not running and left no "
                "result file"
                if job.pid_create_time is not None
                else "job was never started"
            )
        elif code == 0:
            job.state, job.reason = "COMPLETED", None
        else:
            job.state = "FAILED"
            job.reason = f"launcher exited with code {code} without a result file"
        self.store.save_job(job)
        log.info("job %s: %s %s", job.id, job.state, job.reason or "")


def _failure_reason(result: dict[str, Any], first: dict[str, Any] | None) -> str:
    if result.get("outcome") == "signalled":
        return f"torchrun received {result.get('signal_name')}"
    if result.get("outcome") == "error":
        return f"torchrun error: {result.get('error')}"
    if first is None:
        return "a rank failed"
    what = (
        f"signal {first['signal']}"
        if first.get("signal")
        else f"exit code {first.get('exit_code')}"
        if first.get("exit_code") is not None
        else str(first.get("kind"))
    )
    return f"rank {first.get('rank')} failed first: {what}"
