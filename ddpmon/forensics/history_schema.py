"""The layout of a history row and file: shared by the writer (``history.py``) and the reader
(``history_read.py``), which otherwise know nothing of each other."""

from __future__ import annotations

SKIPPED_CODES = {None: 0, "scaler": 1, "policy": 2, "loop": 3}
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
    ("allreduce_count", "int32"),
    ("allreduce_mean_seconds", "float32"),
    ("allreduce_max_seconds", "float32"),
    ("memory_bytes", "int64"),
)
"""The row layout, in tuple order; ``group_norms`` (a fixed-size list) follows the scalars."""
GROUPS_COLUMN = "group_norms"
ROW_FIELDS = tuple(name for name, _ in SCALAR_COLUMNS) + (GROUPS_COLUMN,)
COL = {name: i for i, name in enumerate(ROW_FIELDS)}
"""Position of each field in a row tuple (rows are tuples so the training thread builds them
cheaply; everyone else indexes them by name through this table)."""
