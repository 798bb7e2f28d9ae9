"""SQLite persistence for job records and rank registrations.

One file under the daemon's state directory, so a restart keeps every record. A job row holds
what is needed to re-adopt its launcher after a restart (PID and the process start time, which
tells a live job apart from an unrelated process that reused the PID).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

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
    failures: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    cancel_requested_at: float | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobRecord:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES


class DuplicateJobError(KeyError):
    """A job with this id already exists."""


class Store:
    """Thread-safe: the API handlers and the job watchers share one connection under a lock."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

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
        with self._lock:
            row = self._db.execute("SELECT doc FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return JobRecord.from_json(row[0]) if row else None

    def list_jobs(self, states: tuple[str, ...] | None = None) -> list[JobRecord]:
        with self._lock:
            if states:
                marks = ",".join("?" * len(states))
                rows = self._db.execute(
                    f"SELECT doc FROM jobs WHERE state IN ({marks}) ORDER BY created_at", states
                ).fetchall()
            else:
                rows = self._db.execute("SELECT doc FROM jobs ORDER BY created_at").fetchall()
        return [JobRecord.from_json(r[0]) for r in rows]

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

    def delete_rank(self, run: str, rank: int) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM ranks WHERE run = ? AND rank = ?", (run, rank))
        return cur.rowcount > 0

    def iter_ranks(self) -> Iterator[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT doc FROM ranks ORDER BY run, rank").fetchall()
        for (doc,) in rows:
            yield json.loads(doc)
