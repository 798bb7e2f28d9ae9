"""Reading files that a training job, or anyone able to write into a run dir, controls.

Every reader of run-dir and job files (``timeline``, ``report``, ``manifest``, the daemon's job
outcome) goes through here, so one hostile file cannot hang, exhaust or crash it:

- only regular files are opened (a FIFO would block ``open``, a device would never end), with
  ``O_NONBLOCK`` so that even the check cannot block;
- JSON documents are size-capped, JSON lines are read one bounded line at a time (a 3 GB line
  is skipped without being held), and nesting that would exhaust the parser's recursion is an
  unreadable line, not a ``RecursionError``;
- every problem is returned to the caller to report as damage, never raised past it.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

MAX_LINE_BYTES = 1 << 20
"""A JSON line longer than this is skipped (ddpmon's own events are well under 64 KiB)."""
MAX_DOCUMENT_BYTES = 64 << 20
"""A JSON document larger than this is not read (manifests and summaries are kilobytes)."""


class Unreadable(OSError):
    """A file that is not read: not a regular file, too large, or not parseable."""


@dataclass(frozen=True, slots=True)
class BadLine:
    """One line of a JSON-lines file that was skipped, and why."""

    number: int
    problem: str


def open_regular(path: Path | str) -> IO[bytes]:
    """``path`` opened for reading if it is a regular file; ``Unreadable`` otherwise (a FIFO,
    socket or device never blocks the caller: the open is non-blocking)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise Unreadable(f"{path}: not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def parse_json(data: bytes | str) -> Any:
    """``json.loads`` whose every failure, deep nesting included, is a ``ValueError``."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def load_json(path: Path | str, max_bytes: int = MAX_DOCUMENT_BYTES) -> Any:
    """One JSON document; ``OSError`` when it cannot be read (``Unreadable`` for a special
    file or one over ``max_bytes``), ``ValueError`` when it is no JSON."""
    with open_regular(path) as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise Unreadable(f"{path}: over {max_bytes} bytes")
    return parse_json(data)


def json_lines(
    path: Path | str, max_line: int = MAX_LINE_BYTES, max_lines: int | None = None
) -> Iterator[Any | BadLine]:
    """Each line's JSON value, or a ``BadLine`` (unparseable, nested too deeply, over
    ``max_line`` bytes); blank lines are skipped. Raises ``OSError`` only when the file cannot
    be opened."""
    with open_regular(path) as fh:
        number = 0
        while max_lines is None or number < max_lines:
            line = fh.readline(max_line + 1)
            if not line:
                return
            number += 1
            if len(line) > max_line and not line.endswith(b"\n"):
                while True:  # the rest of the long line, dropped as it is read
                    rest = fh.readline(max_line)
                    if not rest or rest.endswith(b"\n"):
                        break
                yield BadLine(number, f"line over {max_line} bytes")
                continue
            if not line.strip():
                continue
            try:
                yield parse_json(line)
            except ValueError as exc:
                yield BadLine(number, str(exc)[:80] or "not JSON")
