"""docs/architecture.md names every module of ``ddpmon/`` where it lives, and nothing that is gone.

A module counts as named when the page gives its path below ``ddpmon/`` (``agent/monitor.py``,
``ddpmon/recorder/history.py``), or its file name on its package's lines of the map in "The
parts". So a module added, moved or renamed without the page following fails here, and so does
a map line or a ``ddpmon/...`` path that names a module no longer there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ddpmon"
PAGE = ROOT / "docs" / "architecture.md"

_GROUP = re.compile(r"^(\s*)(\w+)/(?=\s|$)")
_BARE = re.compile(r"(?<![\w/.])(\w+\.py)\b")
_PATH = re.compile(r"(?<![\w/.])((?:\w+/)+\w+\.py)\b")


def modules() -> set[str]:
    """Every module's path below ``ddpmon/`` (``agent/monitor.py``, ``__init__.py``)."""
    return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}


def map_block(text: str) -> list[str]:
    """The lines of the ``ddpmon/`` map: the first ``text`` block of "The parts"."""
    section = text.split("## The parts", 1)[1]
    block = section.split("```text\n", 1)[1].split("```", 1)[0]
    return block.splitlines()


def named_in_map(lines: list[str]) -> set[str]:
    """The module paths the map names: each file name joined to the package whose lines hold it
    (a line that starts ``name/`` opens that package, inside the one indented above it, and
    names its ``__init__.py``)."""
    stack: list[tuple[int, str]] = []
    current = ""
    named: set[str] = set()
    for line in lines:
        rest = line
        m = _GROUP.match(line)
        if m:
            indent = len(m.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            name = m.group(2)
            parent = stack[-1][1] if stack else ""
            current = "" if name == "ddpmon" and not stack else f"{parent}{name}/"
            stack.append((indent, current))
            named.add(current + "__init__.py")  # a package is named by its own line
            rest = line[m.end():]
        for bare in _BARE.findall(rest):
            named.add(current + bare)
    return named


def named_by_path(text: str) -> set[str]:
    """Module paths the page gives whole (``ddpmon/`` stripped): ``forensics/stragglers.py``."""
    return {p.removeprefix("ddpmon/") for p in _PATH.findall(text)}


def test_every_module_is_named_where_it_lives():
    text = PAGE.read_text()
    named = named_in_map(map_block(text)) | named_by_path(text)
    missing = sorted(modules() - named)
    assert missing == [], "name these in docs/architecture.md's map (The parts)"


def test_the_map_names_no_module_that_is_gone():
    text = PAGE.read_text()
    stale = sorted(named_in_map(map_block(text)) - modules())
    assert stale == [], "these are not in ddpmon/ (moved or removed): fix the map"
    gone = sorted(p for p in re.findall(r"ddpmon/((?:\w+/)*\w+\.py)", text)
                  if not (PACKAGE / p).is_file())
    assert gone == [], "docs/architecture.md names these ddpmon/ files, which are gone"


def test_the_map_reader_is_not_vacuous():
    """It places a file name in its nested package, and a top-level module at the root."""
    lines = ["ddpmon/", "  cli.py  the command", "  forensics/  readers: timeline.py",
             "    goodput/  account.py,", "              rows.py", "  job/  slurm.py (see x/y.py)"]
    packages = {"__init__.py", "forensics/__init__.py", "forensics/goodput/__init__.py",
                "job/__init__.py"}
    assert named_in_map(lines) - packages == {
        "cli.py", "forensics/timeline.py", "forensics/goodput/account.py",
        "forensics/goodput/rows.py", "job/slurm.py"}
    assert {"agent/monitor.py", "recorder/history.py"} <= modules()
