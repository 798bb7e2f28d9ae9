"""``docs/reference/modules.md``: every module of the package with the first sentence of its
docstring, read with ``ast`` (nothing is imported). A module without a docstring stops the
generator, so no module can be added without its line."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from .markdown import header, table

PACKAGE = Path(__file__).resolve().parents[1]


def first_sentence(doc: str) -> str:
    """The docstring's first paragraph up to its first full stop, on one line."""
    para = " ".join(doc.strip().split("\n\n", 1)[0].split())
    match = re.match(r"(.+?[.!?])(?=\s+[A-Z(`\"']|$)", para)  # not at "e.g. this"
    return match.group(1) if match else para


def module_lines(package: Path = PACKAGE) -> list[tuple[str, str]]:
    """``(path below the package, first sentence)`` of every module, in path order; empty
    ``__init__.py`` files (nothing in them) are skipped."""
    out, missing = [], []
    for path in sorted(package.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        source = path.read_text(encoding="utf-8")
        if path.name == "__init__.py" and not source.strip():
            continue
        doc = ast.get_docstring(ast.parse(source))
        rel = path.relative_to(package).as_posix()
        if not doc:
            missing.append(rel)
            continue
        out.append((rel, first_sentence(doc)))
    if missing:
        raise ValueError(f"modules without a docstring (say in one line what each is): {missing}")
    return out


def modules_page() -> str:
    intro = ("Every module of `ddpmon/`, with the first sentence of its docstring. How they fit "
             "together, and the import layering: [Architecture](../architecture.md).")
    rows = [(f"`ddpmon/{rel}`", text) for rel, text in module_lines()]
    return header("Modules", "the modules' docstrings", intro) + "\n" + table(
        ("module", "what it is"), rows)
