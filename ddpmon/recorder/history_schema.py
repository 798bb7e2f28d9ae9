"""The layout of a history row and file: shared by the writer (``history.py``) and the reader
(``history_read.py``), which otherwise know nothing of each other."""

from __future__ import annotations

from ..metrics.step_fields import IN_HISTORY

SKIPPED_CODES = {None: 0, "scaler": 1, "policy": 2, "loop": 3, "engine": 4}
"""``skipped_by`` as a small integer column; the mapping is also in the schema metadata."""
SKIPPED_NAMES = {v: k for k, v in SKIPPED_CODES.items()}

DERIVED_COLUMNS = (
    # name, arrow type name: columns no single step field holds (built in ``history.row_of``)
    ("collective_count", "int32"),
    ("collective_mean_seconds", "float32"),
    ("collective_max_seconds", "float32"),
    ("memory_bytes", "int64"),
    ("forward_seconds", "float32"),
    ("backward_seconds", "float32"),
    ("optimizer_seconds", "float32"),
    ("host_seconds", "float32"),
    ("wait_seconds", "float32"),
    ("communication_seconds", "float32"),
)
FORMAT_ORDER = (
    "step", "wall_time", "loss", "grad_norm", "grad_local_norm", "grad_nonfinite",
    "local_nonfinite", "origin", "poisoned", "loss_scale", "amp_skipped", "skipped_by",
    "duration_seconds", "data_wait_seconds", *(name for name, _ in DERIVED_COLUMNS),
)
"""The order the columns have been written in since the format's first files (frozen: readers
index by name, but a file's layout follows it). A step field declared later
(``step_fields.IN_HISTORY``) is appended after these, and reads as null from older files."""
_TYPES = {f.name: f.column for f in IN_HISTORY} | dict(DERIVED_COLUMNS)
ADDED_COLUMNS = tuple(f.name for f in IN_HISTORY if f.name not in FORMAT_ORDER)
SCALAR_COLUMNS = tuple((name, _TYPES[name]) for name in (*FORMAT_ORDER, *ADDED_COLUMNS))
"""The row layout, in tuple order; ``group_norms`` (a fixed-size list) follows the scalars."""
OLD_NAMES = {
    "collective_count": "allreduce_count",
    "collective_mean_seconds": "allreduce_mean_seconds",
    "collective_max_seconds": "allreduce_max_seconds",
}
"""Columns renamed since files were first written (new -> old); readers accept either."""
PHASE_COLUMNS = (
    "forward_seconds", "backward_seconds", "optimizer_seconds", "host_seconds", "wait_seconds",
    "communication_seconds",
)
"""A step's parts after its data wait (``agent.step_split.PHASES[1:]``)."""
OPTIONAL_COLUMNS = frozenset((*PHASE_COLUMNS, *ADDED_COLUMNS))
"""Columns added since files were first written: a file without them reads them as null."""


def phase_columns(phases: tuple[float, ...] | None) -> dict[str, float | None]:
    """The phase columns of a record's ``phase_seconds`` (all null where unknown)."""
    values = phases[1:] if phases is not None else (None,) * len(PHASE_COLUMNS)
    return dict(zip(PHASE_COLUMNS, values, strict=True))


STEP_VALUES_KEY = "step_values"
"""Schema metadata: the per-step metrics' columns (a JSON list), in a file that has any."""


def column_of(entry) -> str:
    """A per-step metric's history column: its name (``Config.step_metrics``); one that would
    shadow a column of the format is refused when the metric is chosen."""
    return entry.name


GROUPS_COLUMN = "group_norms"
UPDATE_COLUMNS = {
    "weight_norms": "weight_norm",
    "update_norms": "update_norm",
    "update_ratios": "update_ratio",
    "exp_avg_norms": "exp_avg_norm",
    "exp_avg_sq_norms": "exp_avg_sq_norm",
}
"""Per-group figures of a sampled step (``probes.updates``): column -> the field of
``StepRecord.update_stats``; a fixed-size list like ``group_norms``, null on other steps. Files
written before these columns existed read without them."""
ROW_FIELDS = tuple(name for name, _ in SCALAR_COLUMNS) + (GROUPS_COLUMN, *UPDATE_COLUMNS)
COL = {name: i for i, name in enumerate(ROW_FIELDS)}
"""Position of each field in a row tuple (rows are tuples so the training thread builds them
cheaply; everyone else indexes them by name through this table)."""

COLUMN_DOCS = {
    **{f.name: f.column_doc for f in IN_HISTORY},
    "collective_count": "collectives timed in the step, every op (DDP: one per bucket)",
    "collective_mean_seconds": "mean collective time (null without timed collectives)",
    "collective_max_seconds": "slowest collective of the step",
    "forward_seconds": "the model's forward, every micro-step (null: not timed)",
    "backward_seconds": "forward's end to backward's end, less `wait_seconds`",
    "optimizer_seconds": "the optimizer step (0 where its hooks are not used)",
    "host_seconds": "the rest of the step: the loop's code between the parts above",
    "wait_seconds": "the backward's last collective issued to the backward's end: waiting for "
    "the other ranks (straggler attribution, `ddpmon.forensics.stragglers`)",
    "communication_seconds": "time spent issuing this rank's own collectives (on CPU: blocked "
    "inside the calls; `ddpmon.probes.comm_issue`)",
    "memory_bytes": "CUDA allocated bytes on a GPU, process RSS on CPU (the kind is in the "
    "schema metadata)",
    GROUPS_COLUMN: "per-group norms, a fixed-size list in the order of the `groups` schema "
    "metadata",
    "weight_norms": "per-group weight norm after the step, on sampled steps (`update_every`; "
    "null otherwise), in `groups` order",
    "update_norms": "per-group norm of the update the step applied, ||w_after - w_before||",
    "update_ratios": "per-group update/weight ratio ||dw|| / ||w||",
    "exp_avg_norms": "per-group norm of the optimizer's first moment (Adam family; null "
    "without one)",
    "exp_avg_sq_norms": "per-group norm of the optimizer's second moment",
}
"""What each column holds: the reference page ``docs/reference/files.md`` is generated from it."""


def update_values(stats: dict | None, groups: tuple[str, ...]) -> dict[str, tuple | None]:
    """The update columns of one row from ``StepRecord.update_stats`` (None: not sampled; a
    moment column is None for an optimizer without moments)."""
    out: dict[str, tuple | None] = dict.fromkeys(UPDATE_COLUMNS)
    if not stats:
        return out
    for column, key in UPDATE_COLUMNS.items():
        values = tuple(stats.get(g, {}).get(key) for g in groups)
        if any(v is not None for v in values):
            out[column] = values
    return out
