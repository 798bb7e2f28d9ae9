"""Files ddpmon writes for others to read: one atomic write and one JSON sanitiser.

Why one place: every file here is read by another process (Prometheus, ``ddpmon timeline``,
the daemon) and is written when a process may die at any moment. A reader must see the old
file or the new one, never half of one, so every write goes through a temporary file in the
same directory, ``fsync``, ``os.replace`` and an fsync of the directory. Temporary names start
with ``.`` and end in ``.tmp``, so a Prometheus ``file_sd`` glob (``*.json``) never reads one.

:func:`json_safe` is the one JSON sanitiser: NaN and +/-Inf become the strings ``"nan"``,
``"inf"``, ``"-inf"`` (strict JSON that every consumer parses), mapping keys become strings,
tensor/numpy scalars their value, and anything else its ``str``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

DEFAULT_MODE = 0o644
"""Files are world-readable like the rest of the run dir (``mkstemp`` alone gives 0600)."""

_MAX_DEPTH = 8


def json_safe(value: Any, _depth: int = 0) -> Any:
    """A strict-JSON version of ``value``: non-finite floats as strings, unknown types via str."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if _depth > _MAX_DEPTH:
        return str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [json_safe(v, _depth + 1) for v in value]
    if isinstance(value, Path):
        return str(value)
    item = getattr(value, "item", None)  # torch / numpy scalars
    if callable(item):
        try:
            if getattr(value, "numel", lambda: 1)() == 1:
                return json_safe(item(), _depth + 1)
        except Exception:
            pass
    return str(value)


def dumps(obj: Any, *, indent: int | None = 2, sort_keys: bool = True) -> str:
    """``obj`` as strict JSON text (through :func:`json_safe`); never emits NaN/Infinity."""
    separators = None if indent is not None else (",", ":")
    return json.dumps(
        json_safe(obj), indent=indent, sort_keys=sort_keys, allow_nan=False, separators=separators
    )


def fsync_dir(path: Path | str) -> None:
    """Make a rename or a new entry in ``path`` durable; a no-op where directories can't sync."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_bytes_atomic(path: Path | str, data: bytes, *, mode: int = DEFAULT_MODE) -> Path:
    """Replace ``path`` with ``data`` atomically and durably; create the directory if needed.

    The temporary file is ``.<name>.<random>.tmp`` in the same directory and is removed if
    anything fails. Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return path


def write_text_atomic(path: Path | str, text: str, *, mode: int = DEFAULT_MODE) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8", "replace"), mode=mode)


def write_json_atomic(
    path: Path | str,
    obj: Any,
    *,
    indent: int | None = 2,
    sort_keys: bool = True,
    mode: int = DEFAULT_MODE,
) -> Path:
    """``obj`` as strict JSON (see :func:`json_safe`) plus a newline, written atomically."""
    return write_text_atomic(path, dumps(obj, indent=indent, sort_keys=sort_keys) + "\n", mode=mode)


def append_whole(fd: int, data: bytes) -> None:
    """Append ``data`` to the ``O_APPEND`` descriptor ``fd`` whole, or not at all: a write cut
    short (a full disk) is truncated back to where it began, then the error is raised. Only
    for files with one writing process (a rank's event log or history, under their locks)."""
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        written = os.write(fd, data)
        while written < len(data):  # a short write: the disk filled, or a signal
            written += os.write(fd, data[written:])
    except BaseException:
        try:
            os.ftruncate(fd, start)  # shrinking needs no space
        except OSError:
            pass
        raise


# -- directories: build privately, then publish with one rename --------------------------------


@contextlib.contextmanager
def synced_open(path: Path | str, mode: str = "wb") -> Iterator[IO[Any]]:
    """``open`` that flushes and fsyncs on a clean exit: for files inside a private temporary
    directory that :func:`publish_dir` renames into place afterwards (no per-file rename)."""
    with open(path, mode) as handle:
        yield handle
        handle.flush()
        os.fsync(handle.fileno())


def write_file_synced(path: Path | str, data: bytes | str) -> None:
    """Write and fsync one file inside a private temporary directory."""
    with synced_open(path, "wb") as handle:
        handle.write(data.encode("utf-8", "replace") if isinstance(data, str) else data)


def publish_dir(tmp: Path | str, final: Path | str) -> Path:
    """Rename the fully written directory ``tmp`` to ``final`` (same parent) durably.

    Fails (``OSError``) when ``final`` already exists and is not empty, so a complete
    directory is never replaced by another one."""
    tmp, final = Path(tmp), Path(final)
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    return final
