"""``annotations.json``: run facts only the training script knows (global batch, micro batch,
gradient accumulation, seed, ...), recorded with ``mon.annotate(**fields)`` by rank 0.

Why a file of its own rather than the manifest: the manifest is written once, after the first
step, from what the agent can observe; these facts come from the user at any time and
``ddpmon compare`` needs them to say whether two runs are comparable. Written atomically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..rundir.atomic import write_json_atomic
from ..rundir.damage import ReadWarnings, read_json
from ..rundir.layout import ANNOTATIONS  # noqa: E402
from ..rundir.safe_read import load_json

KNOWN = ("global_batch", "micro_batch", "accumulation", "seed")
"""Fields ``ddpmon compare`` reads; any other JSON-able field is kept as well."""


def annotations_path(run_path: Path | str) -> Path:
    return Path(run_path) / ANNOTATIONS


def check_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """Validate ``annotate`` fields: names are identifiers, the known ones integers >= 0."""
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if not key.isidentifier():
            raise ValueError(f"annotate: {key!r} is not a valid field name")
        if key in KNOWN and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"annotate: {key}={value!r}: expected an integer >= 0")
        out[key] = value
    return out


def write_annotations(run_path: Path | str, fields: dict[str, Any]) -> Path:
    """Merge ``fields`` into the run's annotations and replace the file atomically."""
    path = annotations_path(run_path)
    merged = {**read_annotations(run_path), **fields}
    return write_json_atomic(path, merged)


def read_annotations(run_path: Path | str) -> dict[str, Any]:
    """The run's annotations; {} when there are none or the file is unreadable."""
    try:
        data = load_json(annotations_path(run_path))  # hostile: size, FIFO, nesting
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load_annotations(run_path: Path | str, damage: ReadWarnings) -> dict[str, Any]:
    """:func:`read_annotations` that names a damaged file in ``damage`` (read as {})."""
    return read_json(annotations_path(run_path), damage, kept="run facts from it not used") or {}
