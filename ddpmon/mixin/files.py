"""Writing and diffing generated files: shared by the rule and the dashboard generators, so that
``--write`` and ``--check`` mean exactly the same for every output of the mixin."""

from __future__ import annotations

import difflib
from pathlib import Path


def write_files(root: str | Path, files: dict[str, str]) -> list[Path]:
    """Write ``{relative path: text}`` under ``root`` (folders created); return the paths."""
    root = Path(root)
    paths = []
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def diff_files(root: str | Path, files: dict[str, str]) -> list[str]:
    """Unified diffs of files under ``root`` that differ from ``files`` (missing = empty)."""
    root = Path(root)
    diffs = []
    for rel, text in files.items():
        path = root / rel
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        if current != text:
            diffs.append(
                "".join(
                    difflib.unified_diff(
                        current.splitlines(keepends=True),
                        text.splitlines(keepends=True),
                        fromfile=f"{path} (committed)",
                        tofile=f"{path} (generated)",
                    )
                )
            )
    return diffs
