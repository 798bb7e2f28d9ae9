"""Reading ``history.rank<R>.arrow`` back (the writer is :mod:`ddpmon.recorder.history`).

A file may hold several streams (one per attempt of a restarted run), end in a torn message (a
writer killed mid-write) and have a journal beside it (rows not yet sealed): the reader takes
every complete batch of both files and keeps the last row of each step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..rundir.damage import ReadWarnings, type_name
from ..rundir.layout import HISTORY_JOURNAL_RE, HISTORY_RE, RunDir
from ..rundir.layout import history_journal_of as journal_path
from ..rundir.safe_read import open_regular, parse_json
from .arrow_frames import (
    MAX_HISTORY_BYTES,
    MAX_HISTORY_DECODED_BYTES,
    RECORD_BATCH,
    SCHEMA,
    Frames,
    Torn,
)
from .history_schema import (
    GROUPS_COLUMN,
    OLD_NAMES,
    OPTIONAL_COLUMNS,
    SCALAR_COLUMNS,
    STEP_VALUES_KEY,
    UPDATE_COLUMNS,
)

FORMAT = "1"
MAX_GROUP_COLUMNS = 1024
"""Group norms per row a reader takes (the agent writes at most ``max_groups``, 256)."""
"""The ``ddpmon.history`` schema metadata this reader knows."""


@dataclass(slots=True)
class History:
    """One rank's history as numpy columns, sorted by step, one row per step."""

    rank: int
    groups: list[str]
    columns: dict[str, Any]
    """``name -> numpy array``; ``group_norms`` is a (rows, groups) float array (NaN: none)."""
    memory_kind: str | None = None
    torn: bool = False
    """The file ended in a torn message (the writer was killed mid-write); rows before it kept."""
    step_values: list[str] = field(default_factory=list)
    """The per-step metrics' columns this file has (``step_values`` schema metadata)."""
    stage: str | None = None
    """Pipeline parallel: the rank's stage indices (``"1"``, ``"0,2"``), from the schema
    metadata; None otherwise."""

    def __len__(self) -> int:
        return len(self.columns["step"])

    def group(self, name: str):
        return self.columns[GROUPS_COLUMN][:, self.groups.index(name)]


def read_history(path: Path | str, rank: int | None = None) -> History:
    """Read ``history.rank<R>.arrow`` and its journal (if a crash left one): the union of their
    complete batches, the last row of each step kept.

    Raises ``FileNotFoundError`` (no file) or ``ValueError`` (not a ddpmon history)."""
    path = Path(path)
    reads = [(p, scan_streams(p)) for p in (path, journal_path(path)) if p.exists()]
    if not reads:
        raise FileNotFoundError(f"{path}: no such history file")
    return _assemble(path, [r for _, r in reads], rank)


def load_history(path: Path, rank: int, damage: ReadWarnings) -> History | None:
    """:func:`read_history` for one rank that never raises: a damaged main file or journal is
    named in ``damage`` with the rows kept, and None means nothing of this rank was usable."""
    reads: list[StreamRead] = []
    for p in (path, journal_path(path)):
        try:
            if not p.exists():
                continue
            r = scan_streams(p)
        except OSError as exc:
            damage.add(p, f"unreadable ({exc.strerror or exc})", "skipped")
            continue
        if r.over_cap is not None:
            damage.add(p, r.over_cap, f"using the {r.rows} rows before it" if r.rows
                       else "skipped")
        if r.schema is None:
            if r.over_cap is None:
                what = "empty" if r.size == 0 else "not an Arrow IPC stream written by ddpmon"
                damage.add(p, what, "skipped")
            continue
        version = (r.schema.metadata or {}).get(b"ddpmon.history", b"1").decode("utf-8", "replace")
        if version != FORMAT:
            damage.add(p, f"history format {version!r}, this ddpmon reads {FORMAT!r}",
                       "read the columns it knows")
        if r.torn and not r.rows:
            damage.add(p, "truncated or corrupt before its first complete batch", "skipped")
            continue
        if r.torn:
            est = r.estimated_rows()
            damage.add(p, f"truncated after {r.rows} of ~{est} rows" if est > r.rows
                       else f"truncated after {r.rows} rows", f"using {r.rows}")
        reads.append(r)
    if not reads:
        return None
    try:
        h = _assemble(path, reads, rank, damage)
    except (KeyError, *pa_errors()) as exc:
        why = str(exc).replace(f"{path}: ", "")[:120]
        damage.add(path, f"unreadable ({type(exc).__name__}: {why})", "skipped")
        return None
    if not len(h):
        damage.add(path, "no rows", "skipped")
        return None
    return h


def _assemble(path: Path, reads: list[StreamRead], rank: int | None,
              damage: ReadWarnings | None = None) -> History:
    import numpy as np  # pyarrow only where a history is read or written: a light CLI start
    import pyarrow as pa

    batches = [b for r in reads for b in r.batches]
    schema = next((r.schema for r in reads if r.schema is not None), None)
    torn = any(r.torn for r in reads)
    if schema is None:
        raise ValueError(f"{path}: not an Arrow IPC stream written by ddpmon (no schema)")
    names = {n: n if n in schema.names else OLD_NAMES.get(n, n) for n, _ in SCALAR_COLUMNS}
    missing = [
        n for n, old in names.items() if old not in schema.names and n not in OPTIONAL_COLUMNS
    ]
    if GROUPS_COLUMN not in schema.names:
        missing.append(GROUPS_COLUMN)
    if missing:
        raise ValueError(f"{path}: no column(s) {', '.join(missing)} (another ddpmon version?)")
    batches = [b for b in batches if b.schema.equals(schema)]
    meta = {k.decode("utf-8", "replace"): v.decode("utf-8", "replace")
            for k, v in (schema.metadata or {}).items()}
    width = schema.field(GROUPS_COLUMN).type
    width = width.list_size if pa.types.is_fixed_size_list(width) else None
    groups, problem = group_names(meta.get("groups", "[]"), width)
    if problem is not None and damage is not None:
        damage.add(path, f"schema metadata groups: {problem}",
                   "its group norms named by position" if groups else "group norms not used")
    table = pa.Table.from_batches(batches, schema=schema) if batches else schema.empty_table()
    cols: dict[str, Any] = {}
    for name, _ in SCALAR_COLUMNS:
        if names[name] not in schema.names:  # an optional column an older file lacks
            cols[name] = np.full(len(table), np.nan)
            continue
        arr = table.column(names[name])
        if pa.types.is_floating(arr.type):
            cols[name] = arr.to_numpy(zero_copy_only=False).astype("float64")
        elif pa.types.is_boolean(arr.type):
            cols[name] = arr.fill_null(False).to_numpy(zero_copy_only=False)
        else:
            filled = arr.fill_null(-1 if name == "memory_bytes" else 0)
            cols[name] = filled.to_numpy(zero_copy_only=False)
    if groups:
        flat = table.column(GROUPS_COLUMN).combine_chunks().flatten()
        cols[GROUPS_COLUMN] = flat.to_numpy(zero_copy_only=False).astype("float64").reshape(
            len(table), len(groups))
    else:
        cols[GROUPS_COLUMN] = np.full((len(table), 0), np.nan)
    for name in UPDATE_COLUMNS:  # absent from files written before them: all NaN
        cols[name] = _group_list(table, name, len(groups))
    step_values = step_value_columns(meta.get(STEP_VALUES_KEY), schema, cols)
    for name in step_values:
        cols[name] = table.column(name).to_numpy(zero_copy_only=False).astype("float64")
    # last row of each step wins (journal rows re-read after a seal), sorted by step
    steps = cols["step"]
    order = np.lexsort((np.arange(len(steps)), steps))
    last = np.ones(len(order), dtype=bool)
    if len(order):
        last[:-1] = steps[order][1:] != steps[order][:-1]
    keep = order[last]
    cols = {k: v[keep] for k, v in cols.items()}
    r = rank if rank is not None else _int(meta.get("rank"), -1)
    stage = meta.get("stage")
    return History(r, groups, cols, meta.get("memory_kind"), torn, step_values,
                   stage[:64] if stage else None)


def step_value_columns(text: str | None, schema: Any, taken: dict) -> list[str]:
    """The per-step metrics' columns named in the ``step_values`` metadata (hostile JSON):
    names of float columns of the schema that are no column of the format; others ignored."""
    import pyarrow as pa  # with numpy, only where a history is read: a light CLI start

    if not text:
        return []
    try:
        names = parse_json(text)
    except ValueError:
        return []
    if not isinstance(names, list):
        return []
    return [n for n in dict.fromkeys(names) if isinstance(n, str) and n not in taken
            and n in schema.names and pa.types.is_floating(schema.field(n).type)]


def _group_list(table: Any, name: str, width: int) -> Any:
    """A nullable fixed-size list column as a (rows, width) float array, NaN where null."""
    import numpy as np  # with pyarrow, only where a history is read: a light CLI start

    out = np.full((len(table), width), np.nan)
    if name not in table.schema.names or not width:
        return out
    for i, value in enumerate(table.column(name).to_pylist()):
        if value is not None and len(value) == width:
            out[i] = [np.nan if v is None else v for v in value]
    return out


def group_names(text: str, width: int | None) -> tuple[list[str], str | None]:
    """The group names of the ``groups`` schema metadata, read as hostile JSON, and what is
    wrong with them: they must be a list of ``width`` strings (the ``group_norms`` list size).
    A damaged list gives ``#0``, ``#1``... when the column's width is known, else none."""
    try:
        names = parse_json(text)
    except ValueError as exc:
        names, problem = None, f"not JSON ({str(exc)[:80]})"
    else:
        problem = None
    if problem is None:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            problem = f"a JSON {type_name(names)}, not a list of names"
            if isinstance(names, list):
                problem = "a JSON array holding other things than names"
        elif width is None or width > MAX_GROUP_COLUMNS:
            problem = (f"group_norms holds {width} per row, over {MAX_GROUP_COLUMNS}" if width
                       else "no fixed-size group_norms column")
            width = None
        elif len(names) != width:
            problem = f"{len(names)} names for {width} group norms"
        else:
            return names, None
    return ([f"#{i}" for i in range(width)] if width else []), problem


def _int(v: Any, default: int) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


@dataclass(slots=True)
class StreamRead:
    """What one Arrow file held: its complete batches, first schema, whether it ended torn, and
    where (``good_bytes`` of ``size``), to estimate the rows a truncation lost."""

    batches: list
    schema: Any
    torn: bool
    good_bytes: int
    size: int
    data_start: int = 0
    """Offset after the first schema message, where the rows begin."""
    over_cap: str | None = None
    """Why the read stopped at a cap (:mod:`.arrow_frames`); the batches before it are kept."""

    @property
    def rows(self) -> int:
        return sum(b.num_rows for b in self.batches)

    def estimated_rows(self) -> int:
        """Rows the whole file would hold at the bytes per row of the part read."""
        span = self.good_bytes - self.data_start
        if not self.rows or span <= 0:
            return self.rows
        return self.rows + round((self.size - self.good_bytes) * self.rows / span)


def read_streams(path: Path):
    """Complete record batches of every stream in ``path`` (a file reopened for append holds
    several), the first schema, and whether it ended in a torn message."""
    r = scan_streams(path)
    return r.batches, r.schema, r.torn


def scan_streams(path: Path) -> StreamRead:
    """:func:`read_streams` with the offsets: every batch is validated in full, so a flipped
    byte that breaks a message ends the read there (as a torn message does). The file is read
    one message at a time (:mod:`.arrow_frames`), up to its byte and decoded-size caps."""
    import pyarrow as pa  # pyarrow only where a history is read or written: a light CLI start
    import pyarrow.ipc as ipc

    batches: list = []
    first_schema = schema = None
    torn, over_cap, good, start, decoded = False, None, 0, 0, 0
    with open_regular(path) as fh:  # a FIFO in its place raises (damage), never hangs
        size = os.fstat(fh.fileno()).st_size
        frames = Frames(fh, size)
        try:
            for frame in frames:
                if frame.header == SCHEMA:
                    schema = ipc.read_schema(ipc.read_message(pa.py_buffer(frame.data)))
                    if first_schema is None:
                        first_schema, start = schema, frame.end
                elif frame.header == RECORD_BATCH and schema is not None:
                    decoded += frame.decoded
                    if decoded > MAX_HISTORY_DECODED_BYTES:
                        over_cap = f"its batches decode to over {MAX_HISTORY_DECODED_BYTES} bytes"
                        break
                    message = ipc.read_message(pa.py_buffer(frame.data))
                    batch = ipc.read_record_batch(message, schema)
                    batch.validate(full=True)
                    batches.append(batch)
                good = frame.end
        except (Torn, *pa_errors()):
            torn = True
        good = max(good, frames.markers_end)
        if frames.over_cap:
            over_cap = f"over {MAX_HISTORY_BYTES} bytes ({size} bytes)"
    return StreamRead(batches, first_schema, torn, good, size, start, over_cap)


def pa_errors() -> tuple[type[BaseException], ...]:
    """What pyarrow raises on bytes that are not a valid stream."""
    import pyarrow as pa  # pyarrow only where a history is read or written: a light CLI start

    return (pa.ArrowException, OSError, ValueError, IndexError, TypeError)


def iter_histories(run: RunDir, damage: ReadWarnings):
    """``(rank, History)`` of every rank whose history is usable, one at a time (memory stays
    one rank's); a damaged file is named in ``damage`` and never stops the other ranks."""
    ranks = set(run.ranked(HISTORY_RE)) | set(run.ranked(HISTORY_JOURNAL_RE))
    for rank in sorted(ranks):
        h = load_history(run.history(rank), rank, damage)
        if h is not None:
            yield rank, h
