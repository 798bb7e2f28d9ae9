"""Prometheus ``file_sd_configs`` target file for one rank.

Each rank writes ``<sd_dir>/<filename>`` holding ``[{"targets": [...], "labels": {...}}]`` and
removes it on close, so Prometheus (which watches the directory) starts scraping a rank as soon
as it serves and drops it when it exits cleanly. A rank that is killed leaves its file behind:
that target then reads ``up == 0`` and DdpmonRankDown fires, which is the point.

Writes are atomic (temporary file in the same directory, fsync, ``os.replace``): Prometheus
never reads a half-written file.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path


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
        directory = self.path.parent
        directory.mkdir(parents=True, exist_ok=True)
        data = (json.dumps(self.content(), indent=2, sort_keys=True) + "\n").encode()
        # The temporary name must not match a `*.json` glob in prometheus.yml.
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        with contextlib.suppress(OSError):
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        return self.path

    def remove(self) -> None:
        """Delete the target file; idempotent, and silent if it is already gone."""
        with contextlib.suppress(OSError):
            self.path.unlink()
