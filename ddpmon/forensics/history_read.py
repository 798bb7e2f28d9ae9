"""Reading ``history.rank<R>.arrow`` back (the writer is :mod:`ddpmon.forensics.history`).

A file may hold several streams (one per attempt of a restarted run), end in a torn message (a
writer killed mid-write) and have a journal beside it (rows not yet sealed): the reader takes
every complete batch of both files and keeps the last row of each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..rundir import HISTORY_RE, RunDir
from ..rundir import history_journal_of as journal_path
from .history_schema import GROUPS_COLUMN, SCALAR_COLUMNS


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

    def __len__(self) -> int:
        return len(self.columns["step"])

    def group(self, name: str):
        return self.columns[GROUPS_COLUMN][:, self.groups.index(name)]


def read_history(path: Path | str, rank: int | None = None) -> History:
    """Read ``history.rank<R>.arrow`` and its journal (if a crash left one): the union of their
    complete batches, the last row of each step kept.

    Raises ``FileNotFoundError`` (no file) or ``ValueError`` (not a ddpmon history)."""
    import json

    import numpy as np
    import pyarrow as pa

    path = Path(path)
    batches: list = []
    schema = None
    torn = False
    found = False
    for p in (path, journal_path(path)):
        if not p.exists():
            continue
        found = True
        got, s, t = read_streams(p)
        batches += got
        schema = schema or s
        torn = torn or t
    if not found:
        raise FileNotFoundError(f"{path}: no such history file")
    if schema is None:
        raise ValueError(f"{path}: not an Arrow IPC stream written by ddpmon (no schema)")
    meta = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
    groups = json.loads(meta.get("groups", "[]"))
    table = pa.Table.from_batches(batches, schema=schema) if batches else schema.empty_table()
    cols: dict[str, Any] = {}
    for name, _ in SCALAR_COLUMNS:
        arr = table.column(name)
        if pa.types.is_floating(arr.type):
            cols[name] = arr.to_numpy(zero_copy_only=False).astype("float64")
        elif pa.types.is_boolean(arr.type):
            cols[name] = arr.fill_null(False).to_numpy(zero_copy_only=False)
        else:
            filled = arr.fill_null(-1 if name == "memory_bytes" else 0)
            cols[name] = filled.to_numpy(zero_copy_only=False)
    flat = table.column(GROUPS_COLUMN).combine_chunks().flatten()
    cols[GROUPS_COLUMN] = flat.to_numpy(zero_copy_only=False).astype("float64").reshape(
        len(table), len(groups)
    )
    # last row of each step wins (journal rows re-read after a seal), sorted by step
    steps = cols["step"]
    order = np.lexsort((np.arange(len(steps)), steps))
    last = np.ones(len(order), dtype=bool)
    if len(order):
        last[:-1] = steps[order][1:] != steps[order][:-1]
    keep = order[last]
    cols = {k: v[keep] for k, v in cols.items()}
    r = rank if rank is not None else int(meta.get("rank", "-1"))
    return History(r, groups, cols, meta.get("memory_kind"), torn)


def read_streams(path: Path):
    """Complete record batches of every stream in ``path`` (a file reopened for append holds
    several), the first schema, and whether it ended in a torn message."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    data = pa.BufferReader(pa.py_buffer(path.read_bytes()))
    batches, first_schema, schema, torn = [], None, None, False
    while True:
        reader = ipc.MessageReader.open_stream(data)
        try:
            message = reader.read_next_message()
        except StopIteration:
            if data.tell() >= data.size():
                break
            continue  # an end-of-stream marker; another stream may follow
        except (pa.ArrowInvalid, OSError):
            torn = True
            break
        try:
            while True:
                if message.type == "schema":
                    schema = ipc.read_schema(message)
                    first_schema = first_schema or schema
                elif message.type == "record batch" and schema is not None:
                    batches.append(ipc.read_record_batch(message, schema))
                message = reader.read_next_message()
        except StopIteration:
            if data.tell() >= data.size():
                break
        except (pa.ArrowInvalid, OSError):
            torn = True
            break
    return batches, first_schema, torn


def read_run_histories(run: RunDir) -> dict[int, History]:
    """rank -> history of every rank that left one."""
    return {rank: read_history(p, rank) for rank, p in run.ranked(HISTORY_RE).items()}
