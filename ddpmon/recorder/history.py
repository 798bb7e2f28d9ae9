"""Per-rank numerics history (``history.rank<R>.arrow``): one row per optimizer step.

What ``ddpmon compare`` and ``ddpmon report`` read. The training thread only appends one tuple
to a deque (:class:`HistorySink`); a background thread turns rows into Arrow record batches.

Format: the Arrow IPC *stream* format (pyarrow), zstd-compressed buffers. Why:
- columnar and typed (float32 norms, bit-packed flags, one fixed-size list for the group norms),
  so 100k steps of a 32-group model take a few MB and a reader loads one column without parsing;
- a stream is a sequence of self-contained messages with no footer: a writer killed mid-write
  leaves complete batches followed by a torn one, which the reader drops. Parquet and the Arrow
  *file* format both need a footer written at close, so a SIGKILL would lose everything.

Crash safety without one tiny batch per second in the main file (each Arrow batch carries ~1 KB
of metadata, which would dominate a slow run): rows are first appended, at least every
``flush_seconds``, as small batches to a journal ``history.rank<R>.tail.arrow`` (written and
flushed to the OS, so a SIGKILL loses at most the last ``flush_seconds``). Every ``seal_rows``
rows (or ``seal_seconds``) they are written as one large batch to the main file, fsynced, and
the journal starts over. Readers merge both and keep the last row of each step, so a crash
between the two writes loses nothing. ``close`` seals and removes the journal.

A full disk: each batch goes to its file whole or not at all (:mod:`.history_file`), so both
files stay readable up to their last good batch. Rows that could not be written stay queued and
are written when space returns; while writes fail, at most ``max_pending`` rows wait, and rows
beyond that are dropped and counted (``rows_lost``). Failures and the resume are reported to the
agent's write health (one log line per rank, a ``write_gap`` event).

Reading back: :mod:`ddpmon.recorder.history_read`.

Bounded: the first ``full_rows`` steps (default 100,000) are kept at every step; after that the
stride doubles every ``segment_rows`` kept rows (every 2nd step, then every 4th...), so rows grow
with the logarithm of the step count. Notable steps (non-finite, origin, poisoned, skipped) are
always kept, up to ``notable_max`` of them beyond the stride.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..metrics.state import StepRecord
from ..metrics.step_fields import IN_HISTORY
from ..rundir.atomic import write_bytes_atomic
from ..rundir.layout import RunDir, history_journal_of
from ..rundir.writes import is_write_error
from .history_downsample import Downsampler
from .history_file import StreamAppender
from .history_read import read_streams
from .history_schema import (  # noqa: F401  (re-exported: the history's public names)
    COL,
    GROUPS_COLUMN,
    ROW_FIELDS,
    SCALAR_COLUMNS,
    SKIPPED_CODES,
    SKIPPED_NAMES,
    STEP_VALUES_KEY,
    UPDATE_COLUMNS,
    column_of,
    phase_columns,
    update_values,
)

log = logging.getLogger("ddpmon")

_MEM = COL["memory_bytes"]


journal_path = history_journal_of


def row_of(record: StepRecord, groups: tuple, memory: int | None, step_metrics=()) -> tuple:
    """One step's row: :data:`ROW_FIELDS` by name (a missing column is a ``KeyError``, not a
    shift), then the values of ``step_metrics`` (their ``Metric``s; None: none this step)."""
    ar = [t for times in record.collective_seconds.values() for t in times]
    values = {f.name: getattr(record, f.name) for f in IN_HISTORY}  # the declared fields
    values.update({
        "skipped_by": SKIPPED_CODES.get(record.skipped_by, 0),
        "collective_count": len(ar),
        "collective_mean_seconds": (sum(ar) / len(ar)) if ar else None,
        "collective_max_seconds": max(ar) if ar else None,
        "memory_bytes": memory,
        **phase_columns(record.phase_seconds),
        GROUPS_COLUMN: tuple(record.group_norms.get(g) for g in groups),
        **update_values(record.update_stats, groups),
    })
    steps = tuple(record.step_values.get(metric) for metric in step_metrics)
    return tuple(values[name] for name in ROW_FIELDS) + steps


def schema_for(groups: tuple[str, ...], meta: dict | None = None, step_columns: tuple = ()):
    """The file's schema; ``step_columns``: per-step metrics' float64 columns, at the end."""
    import pyarrow as pa  # pyarrow loads on the history thread only

    fields = [pa.field(name, getattr(pa, kind)()) for name, kind in SCALAR_COLUMNS]
    fields.append(pa.field(GROUPS_COLUMN, pa.list_(pa.float32(), len(groups))))
    fields += [pa.field(name, pa.list_(pa.float32(), len(groups))) for name in UPDATE_COLUMNS]
    fields += [pa.field(name, pa.float64()) for name in step_columns]
    metadata = {
        "ddpmon.history": "1",
        "groups": json.dumps(list(groups)),
        "skipped_by": json.dumps({str(v): k for k, v in SKIPPED_CODES.items()}),
        **({STEP_VALUES_KEY: json.dumps(list(step_columns))} if step_columns else {}),
        **(meta or {}),
    }
    return pa.schema(fields, metadata=metadata)


def batch_of(rows: list[tuple], schema) -> Any:
    import pyarrow as pa  # pyarrow loads on the history thread only

    columns = list(zip(*rows, strict=True))
    arrays = []
    for (_name, kind), values in zip(SCALAR_COLUMNS, columns[:len(SCALAR_COLUMNS)], strict=True):
        arrays.append(pa.array(values, type=getattr(pa, kind)(), from_pandas=False))
    width = schema.field(GROUPS_COLUMN).type.list_size
    flat = [v for norms in columns[len(SCALAR_COLUMNS)] for v in norms]
    child = pa.array(flat, type=pa.float32()) if flat else pa.array([], pa.float32())
    arrays.append(pa.FixedSizeListArray.from_arrays(child, width))
    rest = schema.names[len(SCALAR_COLUMNS) + 1:]  # the update columns, then step values
    for name, values in zip(rest, columns[len(SCALAR_COLUMNS) + 1:], strict=True):
        arrays.append(pa.array(values, type=schema.field(name).type))
    return pa.record_batch(arrays, schema=schema)


@dataclass
class HistoryWriter:
    """Background writer of one rank's history. ``put(row)`` is the only training-thread call."""

    path: Path
    groups: tuple[str, ...]
    meta: dict[str, str] = field(default_factory=dict)
    flush_seconds: float = 1.0
    seal_rows: int = 4096
    seal_seconds: float = 300.0
    memory: Any = None
    """Optional callable giving a memory reading (bytes) for rows that carry none (process RSS
    on CPU); called on the writer thread."""
    downsampler: Downsampler = field(default_factory=Downsampler)
    on_error: Any = None
    """``on_error(probe, exc)``: counts writer-thread failures in ddpmon_agent_errors_total."""
    health: Any = None
    """The agent's :class:`ddpmon.rundir.writes.WriteHealth`: told of failed writes (a full
    disk) and of the next good one; None: such failures go to ``on_error`` too."""
    max_pending: int = 8192
    """Rows kept in memory while writes fail; later rows are dropped (bounded memory)."""
    step_columns: tuple[str, ...] = ()  # the per-step metrics' columns, after the others

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self.journal = journal_path(self.path)
        self._queue: collections.deque[tuple] = collections.deque()
        self._wake = threading.Event()
        self._stop = False
        self._pending: list[tuple] = []
        self._journaled = 0
        self._sealed_at = time.monotonic()
        self.rows_written = 0
        self.rows_lost = 0
        """Rows dropped because writes failed longer than ``max_pending`` rows."""
        self._lost_steps: list[int] = []
        """Steps of rows lost since the last failure report: first and last only."""
        self._unreported_lost = 0
        self.errors = 0
        self._schema: Any = None
        """Built on the writer thread: pyarrow is imported there, not by ``attach``."""
        self._dead = False
        """The thread could not start (pyarrow unusable): rows are no longer queued."""
        self._main = None
        self._journal_writer = None
        self._synced = threading.Condition()
        self._sync_asked = self._sync_done = 0
        """``sync`` tickets: asked, and the last one whose rows the writer has written."""
        self._thread = threading.Thread(target=self._run, name="ddpmon-history", daemon=True)
        self._thread.start()

    def put(self, row: tuple) -> None:
        if not self._dead:
            self._queue.append(row)

    def sync(self, timeout: float) -> bool:
        """Write the rows queued so far to the journal now, not at the next ``flush_seconds``
        (SIGTERM's flush: :mod:`.term_flush`); True once the writer has, within ``timeout``."""
        if self._dead or not self._thread.is_alive():
            return False
        with self._synced:
            self._sync_asked += 1
            ticket = self._sync_asked
        self._wake.set()
        with self._synced:
            return self._synced.wait_for(lambda: self._sync_done >= ticket, max(0.0, timeout))

    def close(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    # ---------------------------------------------------------------- writer thread
    def _run(self) -> None:
        try:
            self._schema = schema_for(self.groups, self.meta, self.step_columns)
        except Exception as exc:
            self._dead = True
            self._queue.clear()
            self._failed(exc, "cannot start")
            return
        try:
            self._recover()
        except Exception as exc:
            self._failed(exc, "could not recover earlier rows")
        while True:
            stopping, asked = self._stop, self._sync_asked
            try:
                self._drain()
                if stopping:
                    self._seal()
                    self._finish()
                    return
                if time.monotonic() - self._sealed_at >= self.seal_seconds or (
                    len(self._pending) >= self.seal_rows
                ):
                    self._seal()
                else:
                    self._write_journal()
            except Exception as exc:  # never let the thread die silently; never raise
                if stopping:  # no later try: rows not in the journal are lost, say so
                    for row in self._pending[self._journaled :]:
                        self._lose(row[COL["step"]])
                self._failed(exc, "write failed")
                if stopping:
                    self._abandon()
                    return
            with self._synced:  # the rows queued before ``asked`` are written (or failed)
                self._sync_done = asked
                self._synced.notify_all()
            self._wake.wait(self.flush_seconds)
            self._wake.clear()

    def _failed(self, exc: Exception, what: str) -> None:
        self.errors += 1
        if self.health is not None and is_write_error(exc):
            lost, self._unreported_lost = self._unreported_lost, 0
            steps, self._lost_steps = list(self._lost_steps), []
            unwritten = self._pending[self._journaled :]
            if unwritten:
                steps += [unwritten[0][COL["step"]], unwritten[-1][COL["step"]]]
            self.health.failed("history", exc, lost=lost, steps=steps)
            return
        if self.on_error is not None:
            self.on_error("history", exc)  # counted, logged once
        elif self.errors <= 3:
            log.error("ddpmon: history %s: %s: %s", self.path, what, exc)

    def _recover(self) -> None:
        """An earlier attempt of this run (a restart under the same run id) left a history,
        maybe a journal and a torn last message: fold its complete rows into one clean stream,
        atomically, before appending. Rows of another layout (the model changed) are dropped."""
        if not (self.path.exists() or journal_path(self.path).exists()):
            return
        import pyarrow as pa  # pyarrow loads on the history thread only
        import pyarrow.ipc as ipc

        batches = []
        for p in (self.path, self.journal):
            if p.exists():
                got, _, _ = read_streams(p)
                batches += [
                    pa.record_batch(b.columns, schema=self._schema)
                    for b in got
                    if b.schema.equals(self._schema, check_metadata=False)
                ]
        sink = pa.BufferOutputStream()
        with ipc.new_stream(sink, self._schema, options=_ipc_options()) as w:
            for b in batches:
                w.write_batch(b)
        write_bytes_atomic(self.path, sink.getvalue().to_pybytes())
        self.journal.unlink(missing_ok=True)

    def _drain(self) -> None:
        mem = None
        while self._queue:
            row = self._queue.popleft()
            if not self.downsampler.keep(row):
                continue
            if len(self._pending) >= self.max_pending:  # writes keep failing: stay bounded
                self._lose(row[COL["step"]])
                continue
            if row[_MEM] is None and self.memory is not None:
                if mem is None:
                    mem = self.memory()
                row = row[:_MEM] + (mem,) + row[_MEM + 1 :]
            self._pending.append(row)

    def _lose(self, step: int) -> None:
        self.rows_lost += 1
        self._unreported_lost += 1
        if self._lost_steps:
            self._lost_steps[1:] = [step]
        else:
            self._lost_steps = [step]

    def _write_journal(self) -> None:
        new = self._pending[self._journaled :]
        if not new:
            return
        if self._journal_writer is None:
            self._journal_writer = self._open(self.journal, truncate=True)
        self._journal_writer.write_batch(batch_of(new, self._schema))
        self._journaled = len(self._pending)
        self._written()

    def _seal(self) -> None:
        self._sealed_at = time.monotonic()
        if not self._pending:
            return
        if self._main is None:
            self._main = self._open(self.path, truncate=False)
        self._main.write_batch(batch_of(self._pending, self._schema))
        self._main.fsync()
        self.rows_written += len(self._pending)
        self._pending, self._journaled = [], 0
        if self._journal_writer is not None:  # start the journal over (its rows are sealed)
            self._journal_writer.close()
            self._journal_writer = None
            self.journal.unlink(missing_ok=True)
        self._written()

    def _written(self) -> None:
        if self.health is not None:
            self.health.succeeded("history")

    def _finish(self) -> None:
        if self._main is not None:
            self._main.close()  # writes the end-of-stream marker
        if self._journal_writer is not None:
            self._journal_writer.close()
        self.journal.unlink(missing_ok=True)

    def _abandon(self) -> None:
        """Close the files after a failed final seal; the journal stays for readers."""
        for appender in (self._main, self._journal_writer):
            if appender is not None:
                try:
                    appender.close()
                except Exception:
                    pass

    def _open(self, path: Path, *, truncate: bool) -> StreamAppender:
        return StreamAppender(path, self._schema, _ipc_options(), truncate=truncate)


def _ipc_options():
    """Stream options (a function: pyarrow is imported only when a history is written)."""
    import pyarrow.ipc as ipc  # pyarrow loads on the history thread only

    return ipc.IpcWriteOptions(compression="zstd")


class HistorySink:
    """The agent's sink: one tuple per step record onto the writer's queue, nothing else."""

    probe = "history"

    def __init__(self, writer: HistoryWriter, memory: Any = None, step_metrics=()) -> None:
        self.writer = writer
        self._groups = writer.groups
        self._step_metrics = tuple(step_metrics)  # their Metrics, in step_columns order
        self._memory = memory
        """Cheap host-side reading (CUDA allocator counters); None on CPU (the writer fills
        the process RSS instead)."""

    @classmethod
    def open(
        cls,
        run_dir: RunDir,
        rank: int,
        groups: list[str],
        device: str,
        on_error: Any = None,
        health: Any = None,
        step_metrics: tuple = (),
        stage: str | None = None,
    ) -> HistorySink | None:
        """One rank's sink (a column per step metric; its stages in the metadata), or None."""
        if importlib.util.find_spec("pyarrow") is None:
            log.warning("ddpmon: pyarrow, a dependency of ddpmon, is missing (pip install "
                        "pyarrow); the numerics history (compare, report) is off")
            return None
        memory, kind = None, "rss"
        if str(device).startswith("cuda"):
            index = torch.device(device).index or 0
            memory, kind = (lambda: torch.cuda.memory_allocated(index)), "cuda_allocated"
        writer = HistoryWriter(
            run_dir.history(rank),
            tuple(groups),
            meta={"rank": str(rank), "memory_kind": kind} | ({"stage": stage} if stage else {}),
            memory=None if memory is not None else process_rss,
            on_error=on_error,
            health=health,
            step_columns=tuple(column_of(e) for e in step_metrics),
        )
        return cls(writer, memory, tuple(e.metric for e in step_metrics))

    def sync(self, timeout: float) -> bool:
        return self.writer.sync(timeout)

    def on_record(self, record: StepRecord) -> None:
        mem = self._memory() if self._memory is not None else None
        self.writer.put(row_of(record, self._groups, mem, self._step_metrics))

    def close(self) -> None:
        self.writer.close()


def process_rss() -> int | None:
    """Resident set size of this process (Linux ``/proc/self/statm``), None elsewhere."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
