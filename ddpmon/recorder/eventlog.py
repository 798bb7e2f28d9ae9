"""Per-rank event log: ``events.rank<R>.jsonl``, one JSON object per line, append-only.

Why this shape: when a job dies, the last thing each rank wrote must already be on disk, and a
rank killed mid-write must not corrupt what came before. Each event is serialised completely
first and then handed to the kernel in a single ``os.write`` on an ``O_APPEND`` descriptor, so
there is no user-space buffer to lose and lines of concurrent writers never interleave. The file
is never truncated or rewritten; a torn last line (power loss) is skipped by readers.

Record fields: ``ts`` (``time.time()`` of this rank; add the ``clock_offset_seconds`` of the
rank's ``start`` event to get rank 0's clock), ``rank``, ``step`` (``null`` when not tied to a
step), ``kind`` and the caller's fields. Non-JSON values are stringified; NaN and +/-Inf become
the strings ``"nan"``, ``"inf"``, ``"-inf"`` so every line is strict JSON.

The kinds ddpmon writes and their fields are declared in :mod:`ddpmon.recorder.event_kinds`
(the reference page ``docs/reference/events.md`` is generated from it). ``emit`` never
raises into training. A write that fails (a full disk) is cut back to the last whole line, so the
file stays readable, and the event is lost: with a ``health`` (the agent's
:class:`ddpmon.rundir.writes.WriteHealth`) it is counted there and later events are tried again;
without one the failure is logged once.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from ..rundir.atomic import append_whole, json_safe
from ..rundir.layout import RunDir
from ..rundir.safe_read import BadLine, json_lines, load_json
from .event_kinds import EVENT_KINDS

log = logging.getLogger("ddpmon.eventlog")

KINDS = tuple(k.name for k in EVENT_KINDS)
"""Event kinds ddpmon writes; other kinds are allowed and shown as they are."""


def events_path(run_path: Path | str, rank: int) -> Path:
    return RunDir(run_path).events(rank)


jsonable = json_safe
"""The one JSON sanitiser (:func:`ddpmon.rundir.atomic.json_safe`), under its former name."""


class EventLog:
    """Appends events for one rank. Thread-safe; ``emit`` never raises."""

    def __init__(self, run_path: Path | str, rank: int, health: Any = None) -> None:
        self.rank = int(rank)
        self.health = health
        """Told of each failed and successful write (``failed``/``succeeded``); None: log once."""
        self.path = events_path(run_path, rank)
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._failed = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if not self._failed:
            self._failed = True
            log.warning("ddpmon event log %s disabled: %s", self.path, exc)

    def emit(self, kind: str, step: int | None = None, **fields: Any) -> None:
        """Append one event (``ts``, ``rank``, ``step``, ``kind`` + ``fields``) and flush it."""
        try:
            record: dict[str, Any] = {"ts": time.time(), "rank": self.rank, "step": step}
            record["kind"] = str(kind)
            for key, value in fields.items():
                if key not in record:
                    record[key] = value
            line = json.dumps(jsonable(record), allow_nan=False, separators=(",", ":")) + "\n"
            data = line.encode("utf-8", "replace")
            with self._lock:
                if self._fd is None:
                    return
                append_whole(self._fd, data)
        except Exception as exc:  # never into training
            if self.health is not None:
                self.health.failed("eventlog", exc, lost=1, steps=(step,))
            else:
                self._fail(exc)
            return
        if self.health is not None:
            self.health.succeeded("eventlog")

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    @property
    def closed(self) -> bool:
        return self._fd is None


def read_events(path: Path | str) -> tuple[list[dict[str, Any]], int]:
    """Events of one file and the number of unreadable lines (a torn last line, garbage, a
    line nested too deeply or over ``safe_read.MAX_LINE_BYTES``); a file that cannot be opened
    (or is not a regular file) has none."""

    events: list[dict[str, Any]] = []
    bad = 0
    try:
        for obj in json_lines(path):
            if isinstance(obj, dict) and not isinstance(obj, BadLine) and "kind" in obj:
                events.append(obj)
            else:
                bad += 1
    except OSError:
        return events, bad
    return events, bad


def progress_path(run_path: Path | str, rank: int) -> Path:
    return RunDir(run_path).progress(rank)


class ProgressFile:
    """``progress.rank<R>.json``: this rank's last completed step and its time, overwritten in
    place (one 64-byte ``pwrite`` per step, no fsync: a few microseconds).

    Why: logging every step as an event would grow the log without bound, yet a rank that dies
    by SIGKILL or SIGSEGV writes nothing at its end. The page cache survives the process, so
    ``ddpmon timeline`` still learns the last step such a rank completed. Never raises."""

    SIZE = 64

    def __init__(self, run_path: Path | str, rank: int, health: Any = None) -> None:
        self.path = progress_path(run_path, rank)
        self.health = health
        """Told of failed and successful updates (a failed one loses nothing: the next one
        overwrites it)."""
        self._fd: int | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        except OSError as exc:
            log.debug("ddpmon progress file %s disabled: %s", self.path, exc)

    def update(self, step: int, ts: float | None = None) -> None:
        fd = self._fd
        if fd is None:
            return
        try:
            when = time.time() if ts is None else ts
            # Formatted by hand (json.dumps costs more than the write); always valid JSON.
            text = f'{{"step": {int(step)}, "ts": {when:.6f}}}'
            os.pwrite(fd, text.ljust(self.SIZE - 1).encode()[: self.SIZE - 1] + b"\n", 0)
        except Exception as exc:
            if self.health is not None:
                self.health.failed("progress", exc, lost=0, steps=(step,))
            return
        if self.health is not None:
            self.health.succeeded("progress")

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


def read_progress(path: Path | str) -> dict[str, Any] | None:
    try:
        data = load_json(path, max_bytes=1 << 16)  # 64 bytes when ddpmon wrote it
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("step"), int) else None
