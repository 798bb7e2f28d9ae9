"""Shared ``--write`` / ``--check`` behaviour of the commands that own generated files."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def write_or_check(
    *,
    write: bool,
    root: str | Path,
    write_fn: Callable[[str | Path], list[Path]],
    check_fn: Callable[[str | Path], list[str]],
    what: str,
    fix: str,
) -> int:
    """Write the files (print each path), or print diffs and return 1 when they are stale."""
    if write:
        for path in write_fn(root):
            print(f"wrote {path}")
        return 0
    diffs = check_fn(root)
    for diff in diffs:
        sys.stdout.write(diff)
    if diffs:
        print(f"{what} out of date: run `{fix}`")
        return 1
    print(f"{what} up to date")
    return 0
