"""Every step row a rank's history holds, the ones a restart computed again included.

``read_history`` keeps the last row of each step (the resumed run's); goodput needs the earlier
attempt's rows too, to time the progress a restart lost. The main file and its journal can hold
the same row twice (a journal re-read after a seal): a row is one (step, wall time)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...recorder.history_read import pa_errors, scan_streams
from ...rundir.damage import ReadWarnings
from ...rundir.layout import HISTORY_JOURNAL_RE, HISTORY_RE, RunDir
from ...rundir.layout import history_journal_of as journal_path

MAX_ROWS_PER_RANK = 2_000_000
"""Rows a reader takes per rank (the history's own byte caps bound them first)."""


@dataclass(frozen=True, slots=True)
class StepRow:
    step: int
    end: float
    """``wall_time`` (this rank's clock) when the step completed."""
    duration: float
    """Step time: first forward (or backward) to the end of the optimizer step."""
    data_wait: float
    """End of the previous step to this step's start (0 for an attempt's first step)."""


def read_rows(path: Path, damage: ReadWarnings | None = None) -> list[StepRow]:
    """One rank's rows from ``history.rank<R>.arrow`` and its journal, sorted by end time."""
    seen: dict[tuple[int, float], StepRow] = {}
    for p in (path, journal_path(path)):
        if not p.exists():
            continue
        try:
            streams = scan_streams(p)
        except (OSError, *pa_errors()) as exc:
            if damage is not None:
                damage.add(p, f"unreadable for goodput ({type(exc).__name__})", "skipped")
            continue
        for batch in streams.batches:
            names = batch.schema.names
            if not {"step", "wall_time", "duration_seconds"} <= set(names):
                continue
            cols = {n: batch.column(names.index(n)).to_pylist()
                    for n in ("step", "wall_time", "duration_seconds", "data_wait_seconds")
                    if n in names}
            waits = cols.get("data_wait_seconds") or [None] * batch.num_rows
            for step, end, dur, wait in zip(cols["step"], cols["wall_time"],
                                            cols["duration_seconds"], waits, strict=False):
                row = _row(step, end, dur, wait)
                if row is not None and len(seen) < MAX_ROWS_PER_RANK:
                    seen[(row.step, row.end)] = row
    return sorted(seen.values(), key=lambda r: r.end)


def rows_by_rank(run: RunDir, damage: ReadWarnings | None = None) -> dict[int, list[StepRow]]:
    ranks = set(run.ranked(HISTORY_RE)) | set(run.ranked(HISTORY_JOURNAL_RE))
    return {rank: read_rows(run.history(rank), damage) for rank in sorted(ranks)}


def _row(step, end, dur, wait) -> StepRow | None:
    if not isinstance(step, int) or not _finite(end) or not _finite(dur) or dur < 0:
        return None
    wait = float(wait) if _finite(wait) and wait >= 0 else 0.0
    return StepRow(step, float(end), float(dur), wait)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and v == v and abs(v) != float("inf")
