"""A small tmpfs that tests can fill up and free again: a real full disk, not a mocked ``write``.

Needs root (``mount``); tests skip with the reason where the mount fails. ``fill()`` writes a
filler file until the file system refuses (``ENOSPC``), ``free()`` deletes it. The tmpfs is
unmounted when the context ends, whatever happened.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class Tmpfs:
    path: Path
    filler_name: str = ".filler"

    @property
    def filler(self) -> Path:
        return self.path / self.filler_name

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.path).free

    def fill(self) -> int:
        """Write the filler until the disk is full; return its size in bytes."""
        chunk = b"\0" * 65536
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            while True:
                try:
                    os.write(fd, chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
            # the last pages: smaller writes until not even one byte fits
            for size in (4096, 512, 1):
                with contextlib.suppress(OSError):
                    while True:
                        os.write(fd, b"\0" * size)
        finally:
            os.close(fd)
        return self.filler.stat().st_size

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "4m") -> Iterator[Tmpfs]:
    """Mount a tmpfs of ``size`` at ``path`` (created); skip the test if that is not possible."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("a full-disk test mounts a tmpfs, which needs root (CI runs as root)")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"could not mount a tmpfs at {path}: {done.stderr.strip()}")
    try:
        yield Tmpfs(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
