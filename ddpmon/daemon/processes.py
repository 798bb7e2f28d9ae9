"""Which process is which on this node: a PID is trusted only together with its start time
(PIDs are reused), a job's process tree is signalled and reaped whole, and ports are probed
before they are handed to a job."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
from dataclasses import dataclass, field

import psutil

BOOT_TIME = psutil.boot_time()
"""The boot time, read once per daemon. psutil's ``create_time()`` adds the boot time it reads
anew at each call, and Linux gives it in whole seconds of the wall clock less the uptime: a
step of the wall clock (NTP, a VM's time sync) across a second moves every process's
``create_time()`` by a second, and a start time compared within 0.05 s then named every live
rank of the node dead at once (all left discovery in one two-node test run)."""


def _started(proc: psutil.Process) -> float:
    """``proc``'s start time on a clock that no wall-clock step moves: its start after boot (what
    ``/proc/<pid>/stat`` holds) plus :data:`BOOT_TIME`."""
    for _ in range(3):
        boot = psutil.boot_time()
        created = proc.create_time()
        if psutil.boot_time() == boot:  # no step between the two reads
            return created - boot + BOOT_TIME
    return created - boot + BOOT_TIME


def process_start_time(pid: int) -> float | None:
    try:
        return _started(psutil.Process(pid))
    except (psutil.Error, ValueError):
        return None


def same_process(pid: int | None, create_time: float | None) -> bool:
    """True when ``pid`` is alive and started at ``create_time`` (not a reused PID)."""
    if not pid or create_time is None:
        return False
    started = process_start_time(pid)
    if started is None or abs(started - create_time) > 0.05:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.errno not in (errno.EADDRINUSE, errno.EACCES)
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def descendants(pid: int) -> dict[int, float]:
    """PID -> start time of every descendant (start time guards against PID reuse)."""
    found: dict[int, float] = {}
    try:
        for child in psutil.Process(pid).children(recursive=True):
            try:
                found[child.pid] = _started(child)
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return found


def descends_from(pid: int, ancestor: int, ancestor_started: float | None) -> bool:
    """Is ``pid`` a descendant of ``ancestor``, the process that started at
    ``ancestor_started`` (a reused PID is not the same ancestor)?"""
    if ancestor_started is None:
        return False
    try:
        for parent in psutil.Process(pid).parents():
            if parent.pid == ancestor:
                return abs(_started(parent) - ancestor_started) <= 0.05
    except psutil.Error:
        return False
    return False


def in_slurm_job(pid: int, slurm_id: str) -> bool:
    """Does ``pid`` run under the ``slurmstepd`` of Slurm job ``slurm_id`` (its process
    title is ``slurmstepd: [<job>.<step>]``)? The ranks of a ``--backend slurm`` job are not
    the daemon's descendants; slurmd starts them."""
    try:
        for parent in psutil.Process(pid).parents():
            if parent.name() == "slurmstepd" and f"[{slurm_id}." in " ".join(parent.cmdline()):
                return True
    except psutil.Error:
        return False
    return False


def signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(os.getpgid(pid), sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass(slots=True)
class JobProcesses:
    """A job's launcher (our child, or re-adopted after a daemon restart) and the descendants
    seen so far: torchrun's workers run in their own sessions, so killing the launcher's group
    alone could leave one behind."""

    job_id: str
    popen: subprocess.Popen[bytes] | None = None
    proc: psutil.Process | None = None  # re-adopted (not our child)
    known_pids: dict[int, float] = field(default_factory=dict)
    killed: bool = False

    def returncode(self) -> tuple[bool, int | None]:
        """(done, exit code if known)."""
        if self.popen is not None:
            code = self.popen.poll()
            return code is not None, code
        assert self.proc is not None
        try:
            done = not self.proc.is_running() or self.proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            done = True
        return done, None

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen is not None else self.proc.pid  # type: ignore[union-attr]

    def remember_descendants(self) -> None:
        self.known_pids |= descendants(self.pid)

    def terminate(self) -> None:
        """SIGTERM to the launcher's group: torchrun passes it on to its workers."""
        self.remember_descendants()
        signal_group(self.pid, signal.SIGTERM)

    def kill_all(self) -> None:
        known = {**self.known_pids, **descendants(self.pid)}
        signal_group(self.pid, signal.SIGKILL)
        for pid, started in known.items():
            if same_process(pid, started):
                signal_group(pid, signal.SIGKILL)
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def reap_leftovers(self) -> None:
        """Kill every descendant seen while the job ran that still lives after it ended."""
        for pid, started in self.known_pids.items():
            if same_process(pid, started):
                try:
                    psutil.Process(pid).kill()
                except psutil.Error:
                    pass
