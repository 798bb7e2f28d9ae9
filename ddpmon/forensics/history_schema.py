"""The layout of a history row and file: shared by the writer (``history.py``) and the reader
(``history_read.py``), which otherwise know nothing of each other."""

from __future__ import annotations

SKIPPED_CODES = {None: 0, "scaler": 1, "policy": 2, "loop": 3, "engine": 4}
"""``skipped_by`` as a small integer column; the mapping is also in the schema metadata."""
SKIPPED_NAMES = {v: k for k, v in SKIPPED_CODES.items()}

SCALAR_COLUMNS = (
    # name, arrow type name
    ("step", "int64"),
    ("wall_time", "float64"),
    ("loss", "float32"),
    ("grad_norm", "float32"),
    ("grad_local_norm", "float32"),
    ("grad_nonfinite", "bool_"),
    ("local_nonfinite", "bool_"),
    ("origin", "bool_"),
    ("poisoned", "bool_"),
    ("loss_scale", "float32"),
    ("amp_skipped", "bool_"),
    ("skipped_by", "uint8"),
    ("duration_seconds", "float32"),
    ("data_wait_seconds", "float32"),
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
OPTIONAL_COLUMNS = frozenset(PHASE_COLUMNS)
"""Columns added since files were first written: a file without them reads them as null."""


def phase_columns(phases: tuple[float, ...] | None) -> dict[str, float | None]:
    """The phase columns of a record's ``phase_seconds`` (all null where unknown)."""
    values = phases[1:] if phases is not None else (None,) * len(PHASE_COLUMNS)
    return dict(zip(PHASE_COLUMNS, values, strict=True))


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
    "step": "optimizer step (the loop's own counter)",
    "wall_time": "`time.time()` when the step completed",
    "loss": "this rank's loss of the step (`observe_loss`, an integration), unscaled; null "
    "when not reported",
    "grad_norm": "global L2 norm of the reduced, unscaled gradients, before clipping",
    "grad_local_norm": "this rank's norm before the reduction (null when not measured that step)",
    "grad_nonfinite": "the reduced gradients held NaN/Inf",
    "local_nonfinite": "this rank's local gradients held NaN/Inf",
    "origin": "this rank was an origin of non-finite gradients at this step",
    "poisoned": "non-finite only because an earlier non-finite step was applied",
    "loss_scale": "AMP loss scale (null without a loss scaler)",
    "amp_skipped": "the loss scaler (a GradScaler or DeepSpeed fp16) skipped the step",
    "skipped_by": "who skipped the step: 0 none, 1 scaler, 2 policy (`on_nonfinite=skip`), "
    "3 loop, 4 engine (DeepSpeed bf16/fp32)",
    "duration_seconds": "step time",
    "data_wait_seconds": "end of the previous step to the first forward of this one",
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
