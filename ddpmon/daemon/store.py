"""SQLite persistence for job records and rank registrations.

One file under the daemon's state directory, so a restart keeps every record. A job row holds
what is needed to re-adopt its launcher after a restart (PID and the process start time, which
tells a live job apart from an unrelated process that reused the PID).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

log = logging.getLogger("ddpmon.daemon.store")

JOB_STATES = ("PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "LOST")
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "LOST"})

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    doc TEXT NOT NULL,
    state TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS ranks (
    run TEXT NOT NULL,
    rank INTEGER NOT NULL,
    doc TEXT NOT NULL,
    PRIMARY KEY (run, rank)
);
"""


@dataclass(slots=True)
class JobRecord:
    """One submitted job; serialised whole into the ``doc`` column (schema-free evolution)."""

    id: str
    entrypoint: str
    nproc: int
    args: list[str] = field(default_factory=list)
    state: str = "PENDING"
    reason: str | None = None
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    ended_at: float | None = None
    pid: int | None = None
    pid_create_time: float | None = None
    exit_code: int | None = None
    ports: list[int] = field(default_factory=list)
    run_dir: str = ""
    job_dir: str = ""
    ranks: dict[str, dict[str, Any]] = field(default_factory=dict)
    first_failure: dict[str, Any] | None = None
    verdict: dict[str, str] | None = None
    failures: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    cancel_requested_at: float | None = None
    slurm_job_id: str | None = None
    """The Slurm job running it (``--backend slurm``)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobRecord:
        """Raises ``ValueError`` when ``text`` is not a job record (not JSON, another shape)."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not a job record")
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as exc:  # a required field missing
            raise ValueError(str(exc)) from None

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES


class DuplicateJobError(KeyError):
    """A job with this id already exists."""


class StoreError(Exception):
    """The store file, or one record in it, cannot be read; the message names it and says
    what to do."""


def _private_files(path: Path) -> None:
    """The database and its WAL files readable by the daemon's user only: created 0600, and an
    existing one tightened (SQLite gives -wal and -shm the database file's mode)."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    for name in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        with contextlib.suppress(FileNotFoundError):
            if stat.S_IMODE(name.stat().st_mode) & 0o077:
                os.chmod(name, 0o600)


class Store:
    """Thread-safe: the API handlers and the job watchers share one connection under a lock."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._skipped: set[str] = set()
        _private_files(self.path)
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        try:
            check = self._db.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise sqlite3.DatabaseError(f"integrity check: {check[0] if check else '?'}")
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise StoreError(
                f"{self.path}: not a usable SQLite database ({exc}); move it aside (e.g. to "
                f"{self.path.name}.damaged) and the daemon starts with an empty job list (the "
                "runs' own run dirs are untouched)"
            ) from None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # jobs
    def insert_job(self, job: JobRecord) -> None:
        with self._lock:
            try:
                self._db.execute(
                    "INSERT INTO jobs (id, doc, state, created_at) VALUES (?, ?, ?, ?)",
                    (job.id, job.to_json(), job.state, job.created_at),
                )
            except sqlite3.IntegrityError:
                raise DuplicateJobError(job.id) from None

    def save_job(self, job: JobRecord) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE jobs SET doc = ?, state = ? WHERE id = ?",
                (job.to_json(), job.state, job.id),
            )

    def get_job(self, job_id: str) -> JobRecord | None:
        """The job, None when there is none; :class:`StoreError` when its record is damaged
        (never reported as missing)."""
        with self._lock:
            row = self._db.execute("SELECT doc FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            return None
        try:
            return JobRecord.from_json(row[0])
        except ValueError as exc:
            raise StoreError(f"{self.path}: job {job_id!r}: unreadable record ({exc})") from None

    def list_jobs(self, states: tuple[str, ...] | None = None) -> list[JobRecord]:
        with self._lock:
            if states:
                marks = ",".join("?" * len(states))
                rows = self._db.execute(
                    f"SELECT doc FROM jobs WHERE state IN ({marks}) ORDER BY created_at", states
                ).fetchall()
            else:
                rows = self._db.execute("SELECT doc FROM jobs ORDER BY created_at").fetchall()
        return self._records(rows)

    def _records(self, rows: list[tuple[str]]) -> list[JobRecord]:
        """Every readable record; an unreadable one is skipped and logged (once per record)."""
        out = []
        for (doc,) in rows:
            try:
                out.append(JobRecord.from_json(doc))
            except ValueError as exc:
                key = str(doc)[:200]
                if key not in self._skipped:
                    self._skipped.add(key)
                    log.warning("%s: unreadable job record skipped (%s): %.80s", self.path, exc,
                                doc)
        return out

    def count_by_state(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall()
        counts = dict.fromkeys(JOB_STATES, 0)
        counts.update({state: int(n) for state, n in rows})
        return counts

    # rank registrations
    def put_rank(self, run: str, rank: int, doc: dict[str, Any]) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO ranks (run, rank, doc) VALUES (?, ?, ?)",
                (run, rank, json.dumps(doc, sort_keys=True)),
            )

    def get_rank(self, run: str, rank: int) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT doc FROM ranks WHERE run = ? AND rank = ?", (run, rank)
            ).fetchone()
        try:
            data = json.loads(row[0]) if row else None
        except ValueError:
            data = None
        return data if isinstance(data, dict) else None

    def delete_rank(self, run: str, rank: int) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM ranks WHERE run = ? AND rank = ?", (run, rank))
        return cur.rowcount > 0

    def iter_ranks(self) -> Iterator[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT doc FROM ranks ORDER BY run, rank").fetchall()
        for (doc,) in rows:
            try:
                data = json.loads(doc)
            except ValueError:
                data = None
            if isinstance(data, dict):
                yield data
            else:
                log.warning("%s: unreadable rank registration skipped: %.80s", self.path, doc)
