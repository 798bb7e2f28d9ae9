"""Reading a damaged run dir: one :class:`Damage` record per damaged file, and the tolerant
JSON readers that fill a :class:`ReadWarnings` collector.

Why: forensics are read after something went wrong, so the run dir is often damaged (a rank
killed mid-write, a full disk, a file copied by hand or written by another ddpmon version). A
reader must use what is readable, never drop a good rank because another rank's file is bad,
and say which file was damaged and what it skipped: a silent partial answer is the worst one.
Every reader takes one collector; the CLI prints one line per damaged file on stderr and
``--json`` carries the same lines under ``warnings`` and the records under ``damaged``.

A file that is absent is not damage (most files are optional); a file that is present but
unreadable is, and is never reported as missing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .safe_read import MAX_DOCUMENT_BYTES, MAX_LINE_BYTES, open_regular, parse_json


@dataclass(frozen=True, slots=True)
class Damage:
    """One damaged file: what was wrong with it and what the reader kept of it."""

    file: str
    """The file's name, relative to the run dir when it lies inside it."""
    problem: str
    """What is wrong, e.g. ``truncated after 12 of ~40 rows``."""
    kept: str
    """What the reader did about it, e.g. ``using 12`` or ``skipped``."""

    def line(self) -> str:
        return f"{self.file}: {self.problem}; {self.kept}"

    def to_json(self) -> dict[str, str]:
        return {"file": self.file, "problem": self.problem, "kept": self.kept}


@dataclass(slots=True)
class ReadWarnings:
    """The damaged files one reader met, in the order met; a file is named once per problem."""

    root: Path | None = None
    """Names are given relative to this directory (the run dir) when a file lies inside it."""
    items: list[Damage] = field(default_factory=list)

    def add(self, path: Path | str, problem: str, kept: str) -> Damage:
        """Record one problem of one file; the same problem met again by another part of the
        reader is kept once (with what the first part kept)."""
        d = Damage(self.name(path), problem, kept)
        for seen in self.items:
            if (seen.file, seen.problem) == (d.file, d.problem):
                return seen
        self.items.append(d)
        return d

    def merge(self, other: ReadWarnings, prefix: str = "") -> None:
        """Take another reader's records, their file names prefixed (e.g. another run's)."""
        for d in other.items:
            if not any((s.file, s.problem) == (prefix + d.file, d.problem) for s in self.items):
                self.items.append(Damage(prefix + d.file, d.problem, d.kept))

    def name(self, path: Path | str) -> str:
        p = Path(path)
        if self.root is not None:
            try:
                return str(p.relative_to(self.root))
            except ValueError:
                pass
        return p.name if self.root is not None else str(p)

    def lines(self) -> list[str]:
        return [d.line() for d in self.items]

    def to_json(self) -> list[dict[str, str]]:
        return [d.to_json() for d in self.items]

    def files(self) -> set[str]:
        return {d.file for d in self.items}


def read_json(
    path: Path | str,
    damage: ReadWarnings,
    *,
    kept: str = "skipped",
    check: Callable[[dict[str, Any]], str | None] | None = None,
) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when it is absent (no warning) or damaged (one
    warning saying why and ``kept``). ``check`` returns a problem with a parsed object (a wrong
    shape) or None when it is usable."""
    path = Path(path)
    try:
        with open_regular(path) as fh:  # a FIFO or device in its place is damage, not a hang
            raw = fh.read(MAX_DOCUMENT_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        damage.add(path, f"unreadable ({exc.strerror or exc})", kept)
        return None
    if len(raw) > MAX_DOCUMENT_BYTES:
        damage.add(path, f"over {MAX_DOCUMENT_BYTES} bytes, not read", kept)
        return None
    data, problem = parse_json_object(raw)
    if problem is None and data is not None and check is not None:
        problem = check(data)
    if problem is not None:
        damage.add(path, problem, kept)
        return None
    return data


def parse_json_object(raw: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """``(object, None)`` or ``(None, what is wrong)`` for the bytes of a JSON-object file."""
    if not raw.strip():
        return None, "empty" if not raw else "blank (only whitespace)"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        # ends mid-document: the error is at the end, or a string runs to the end unclosed
        if exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated string"):
            return None, f"truncated JSON (ends after {len(raw)} bytes)"
        return None, f"not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
    except ValueError as exc:  # e.g. a number too large to convert
        return None, f"not JSON ({exc})"
    except RecursionError:
        return None, "not JSON (nested too deeply)"
    if not isinstance(data, dict):
        return None, f"a JSON {type_name(data)}, not the object expected"
    return data, None


def read_json_lines(
    path: Path | str,
    damage: ReadWarnings,
    valid: Callable[[Any], bool] = lambda obj: isinstance(obj, dict),
) -> list[dict[str, Any]]:
    """The valid objects of a JSON-lines file; unreadable lines (torn, garbage, not UTF-8, the
    wrong shape) are skipped and counted in one warning. An empty file is not damage here (a
    log opened before its first line); the caller knows when it is."""
    path = Path(path)
    try:
        fh = open_regular(path)  # a FIFO or device in its place is damage, not a hang
    except FileNotFoundError:
        return []
    except OSError as exc:
        damage.add(path, f"unreadable ({exc.strerror or exc})", "skipped")
        return []
    out: list[dict[str, Any]] = []
    bad = total = 0
    last_bad = ended = False
    with fh:
        for line, newline in _bounded_lines(fh):
            ended = newline  # of the last line read: a torn last line has none
            if not line.strip():
                continue
            total += 1
            try:
                obj = parse_json(line) if line is not _TOO_LONG else None
            except ValueError:
                obj = None
            if obj is not None and valid(obj):
                out.append(obj)
                last_bad = False
            else:
                bad += 1
                last_bad = True
    if bad:
        torn = " (the last one torn)" if last_bad and bad == 1 and not ended else ""
        damage.add(path, f"{bad} of {total} lines unreadable{torn}",
                   f"using {len(out)} line(s)")
    return out


_TOO_LONG = b"\0 line over the limit"
"""Stands in for a line longer than ``MAX_LINE_BYTES`` (dropped as it is read)."""


def _bounded_lines(fh) -> Iterator[tuple[bytes, bool]]:
    """``(line, ends with a newline)`` of a binary file, each line read up to
    ``MAX_LINE_BYTES``; a longer one is consumed without being held and yields ``_TOO_LONG``."""
    while True:
        line = fh.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while True:
                rest = fh.readline(MAX_LINE_BYTES)
                if not rest or rest.endswith(b"\n"):
                    break
            yield _TOO_LONG, bool(rest)
            continue
        yield line, line.endswith(b"\n")


def check_version(
    data: dict[str, Any], key: str, known: int, path: Path | str, damage: ReadWarnings
) -> None:
    """Warn when ``data[key]`` names a newer format than this ddpmon reads (``known``): the
    fields it knows are still read."""
    v = data.get(key)
    try:
        newer = v is not None and int(v) > known
    except (TypeError, ValueError):
        newer = True
    if newer:
        damage.add(path, f"{key} {v!r} is not one this ddpmon reads (up to {known}): written by "
                   "another version", "read the fields it knows")


def type_name(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", int: "number", float: "number",
            bool: "boolean", type(None): "null"}.get(type(v), type(v).__name__)
