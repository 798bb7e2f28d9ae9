"""A rank's numerics history read with pyarrow alone, not with ddpmon's reader: tests that
check what ddpmon's forensics made of a history compare against this independent reading."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def history_column(run_dir: Path, rank: int, column: str) -> dict[int, Any]:
    """``step -> value`` of ``column`` in ``history.rank<rank>.arrow`` (an Arrow IPC stream,
    possibly several appended as the run went; a null is kept as None)."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    values: dict[int, Any] = {}
    reader = pa.BufferReader((run_dir / f"history.rank{rank}.arrow").read_bytes())
    while reader.tell() < reader.size():
        table = ipc.open_stream(reader).read_all()
        values.update(zip(table.column("step").to_pylist(), table.column(column).to_pylist(),
                          strict=True))
    return values
