"""Prometheus ``file_sd_configs`` target file for one rank.

Each rank writes ``<sd_dir>/<filename>`` holding ``[{"targets": [...], "labels": {...}}]`` and
removes it on close, so Prometheus (which watches the directory) starts scraping a rank as soon
as it serves and drops it when it exits cleanly. A rank that is killed leaves its file behind:
that target then reads ``up == 0`` and DdpmonRankDown fires, which is the point.

Writes go through :func:`ddpmon.rundir.atomic.write_json_atomic` (temporary file in the same
directory, fsync, ``os.replace``, mode 0644): Prometheus never reads a half-written file, and
the temporary name starts with ``.`` so a ``*.json`` glob in prometheus.yml never matches it.
The per-rank file name is :func:`ddpmon.rundir.layout.sd_filename`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from ..rundir.atomic import write_json_atomic


class FileSDPublisher:
    """Publishes one target with its labels; ``remove()`` never raises (it runs at exit)."""

    def __init__(
        self, sd_dir: str | Path, *, target: str, labels: dict[str, str], filename: str
    ) -> None:
        if not filename.endswith(".json") or "/" in filename or filename.startswith("."):
            raise ValueError(f"filename={filename!r}: expected a plain name ending in .json")
        self.path = Path(sd_dir) / filename
        self.target = target
        self.labels = {str(k): str(v) for k, v in labels.items()}

    def content(self) -> list[dict]:
        """The file_sd document for this rank."""
        return [{"targets": [self.target], "labels": dict(self.labels)}]

    def publish(self) -> Path:
        """Write (or replace) the target file atomically; create the directory if needed."""
        return write_json_atomic(self.path, self.content(), indent=2, sort_keys=True, mode=0o644)

    def remove(self) -> None:
        """Delete the target file; idempotent, and silent if it is already gone."""
        with contextlib.suppress(OSError):
            self.path.unlink()
