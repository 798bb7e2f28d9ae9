"""Small real history files (``history.rank<R>.arrow``) written the way the agent writes them
(the writer's own schema, batches and zstd stream options), and run dirs around them, for
tests of what readers do with hostile ones."""

from __future__ import annotations

import json
from pathlib import Path

from ddpmon.metrics.state import StepRecord
from ddpmon.recorder.history import _ipc_options, batch_of, row_of, schema_for

GROUPS = ("embed", "encoder", "head")


def record(step: int, loss: float | None = None) -> StepRecord:
    return StepRecord(
        step=step, wall_time=1000.0 + step, duration_seconds=0.01, data_wait_seconds=0.001,
        loss=2.0 - step * 1e-3 if loss is None else loss, grad_norm=1.0 + step * 0.01,
        group_norms={g: 0.1 * (i + 1) for i, g in enumerate(GROUPS)}, loss_scale=None,
    )


def history_bytes(steps: int, groups: tuple[str, ...] = GROUPS, rank: int = 0,
                  meta: dict[str, str] | None = None) -> bytes:
    """One stream (schema, one batch of ``steps`` rows, end marker), as the writer seals it."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    schema = schema_for(groups, {"rank": str(rank), **(meta or {})})
    rows = [row_of(record(s), groups, 1 << 20) for s in range(steps)]
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, schema, options=_ipc_options()) as w:
        w.write_batch(batch_of(rows, schema))
    return sink.getvalue().to_pybytes()


def history_run(root: Path, name: str, steps: int = 20, ranks: int = 2) -> Path:
    """A run dir with each rank's ``start`` and ``exit`` events and a sealed history."""
    run = root / name
    run.mkdir(parents=True)
    for rank in range(ranks):
        with open(run / f"events.rank{rank}.jsonl", "w") as fh:
            fh.write(json.dumps({"ts": 1000.0, "rank": rank, "step": None, "kind": "start",
                                 "clock_offset_seconds": 0.0, "world_size": ranks}) + "\n")
            fh.write(json.dumps({"ts": 1000.0 + steps, "rank": rank, "step": steps - 1,
                                 "kind": "exit", "reason": "close", "code": 0}) + "\n")
        (run / f"history.rank{rank}.arrow").write_bytes(history_bytes(steps, rank=rank))
    return run
