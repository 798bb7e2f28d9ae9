"""Hang detection: a daemon thread that notices when no step has completed for too long.

Why a thread: a hung rank's training thread is stuck (in a collective, a data loader, a
deadlock), so only another thread can report it. The watchdog only observes: it calls
``on_stall`` once per stall episode and leaves the process running, because killing is the
launcher's job and a live hung process is what a debugger (py-spy, gdb) needs.

:func:`request_flight_recorder_dump` asks torch.distributed's flight recorder (the ring buffer of
recent collectives, ``TORCH_FR_BUFFER_SIZE`` / ``TORCH_NCCL_TRACE_BUFFER_SIZE``) for a dump. In
torch 2.13 the recorder exists for NCCL *and* gloo process groups (``_dump_fr_trace``); older
NCCL-only builds expose ``_dump_nccl_trace``. The dump tells which collective each rank last
enqueued and completed: the rank that is behind is the one that stopped.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .._torch_compat import flight_recorder_dumps
from ..rundir.atomic import write_bytes_atomic
from ..rundir.layout import FLIGHT_RECORDER_DIR, FLIGHT_RECORDER_PREFIX, RunDir
from ..rundir.safe_read import load_json

log = logging.getLogger("ddpmon.watchdog")

__all__ = [
    "FLIGHT_RECORDER_DIR",
    "FLIGHT_RECORDER_PREFIX",
    "StallWatchdog",
    "flight_recorder_path",
    "read_flight_recorder_status",
    "request_flight_recorder_dump",
]


class StallWatchdog:
    """Calls ``on_stall(idle_seconds)`` once when ``time.perf_counter() - heartbeat()`` first
    exceeds ``stall_seconds``; re-arms when the heartbeat moves (a step completed). The heartbeat
    is on ``perf_counter``'s clock, which no wall-clock step moves: on the wall clock a step of
    the system time (NTP, a VM's time sync) read as idle time, and raised a stall in a step that
    took 0.43 s."""

    def __init__(
        self,
        stall_seconds: float,
        heartbeat: Callable[[], float],
        on_stall: Callable[[float], None],
        *,
        poll_seconds: float | None = None,
    ) -> None:
        if stall_seconds <= 0:
            raise ValueError(f"stall_seconds={stall_seconds!r}: expected > 0")
        self.stall_seconds = float(stall_seconds)
        self.heartbeat = heartbeat
        self.on_stall = on_stall
        self.poll_seconds = (
            float(poll_seconds) if poll_seconds else min(max(stall_seconds / 4.0, 0.05), 5.0)
        )
        self.episodes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fired_for: float | None = None  # heartbeat value of the episode already reported
        self._warned = False

    def start(self) -> StallWatchdog:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ddpmon-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def check(self, now: float | None = None) -> bool:
        """One poll (the thread's body); True when it reported a new stall."""
        try:
            beat = float(self.heartbeat())
        except Exception as exc:
            self._warn(exc)
            return False
        idle = (time.perf_counter() if now is None else now) - beat
        if idle < self.stall_seconds or self._fired_for == beat:
            return False
        self._fired_for = beat
        self.episodes += 1
        try:
            self.on_stall(idle)
        except Exception as exc:  # the watchdog outlives a failing callback
            self._warn(exc)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            self.check()

    def _warn(self, exc: BaseException) -> None:
        if not self._warned:
            self._warned = True
            log.warning("ddpmon stall watchdog: %s (later errors are silent)", exc)


def flight_recorder_path(run_path: Path | str, rank: int) -> Path:
    """Where the agent asks for rank's dump: ``run_path/flight_recorder/fr_trace_rank_<R>``
    (pickle, the format ``python -m torch.distributed.flight_recorder.fr_trace`` reads) with a
    JSON twin ``...fr_trace_rank_<R>.json`` that ``ddpmon timeline`` reads."""
    return RunDir(run_path).flight_recorder(rank)


def request_flight_recorder_dump(path: Path | str) -> bool:
    """Dump this process's flight recorder to ``path`` (pickle) and ``path.json`` (JSON).

    True when a dump was written. False (and a debug log saying why) without an initialised
    process group, without a recorder in this torch build, or on any error. Safe to call from a
    thread while the training thread is blocked inside a collective."""
    try:
        if not (dist.is_available() and dist.is_initialized()):
            log.debug("flight recorder: no process group, nothing to dump")
            return False
        dump_pickle, dump_json = flight_recorder_dumps()
    except Exception as exc:
        log.debug("flight recorder unavailable: %s", exc)
        return False
    if dump_pickle is None and dump_json is None:
        log.debug("flight recorder: this torch build has no dump function")
        return False
    path = Path(path)
    written = False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if dump_pickle is not None:
            write_bytes_atomic(path, bytes(dump_pickle()))
            written = True
        if dump_json is not None:
            data = bytes(dump_json())
            json.loads(data)  # keep only a dump that parses
            write_bytes_atomic(path.with_name(path.name + ".json"), data)
            written = True
    except Exception as exc:
        log.debug("flight recorder dump failed: %s", exc)
    return written


def read_flight_recorder_status(path: Path | str) -> dict[str, Any] | None:
    """``pg_status`` of a JSON dump (per process group: last enqueued/started/completed
    collective sequence ids), or None when missing or unreadable."""

    try:
        data = load_json(path)  # a dump in a run dir: hostile (size, FIFO, nesting)
    except (OSError, ValueError):
        return None
    status = data.get("pg_status") if isinstance(data, dict) else None
    return status if isinstance(status, dict) else None
