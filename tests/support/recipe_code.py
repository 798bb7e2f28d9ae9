"""The Python example of a recipe in docs/architecture.md, as a recipe test runs it: the test
follows the text a reader follows, so the page cannot drift from what works."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def recipe_code(heading: str) -> str:
    """The first ``python`` block under ``### <heading>``, before the next heading."""
    text = PAGE.read_text(encoding="utf-8")
    start = text.index(f"\n### {heading}\n")
    section = re.split(r"\n##+ ", text[start + 1:].split("\n", 1)[1], maxsplit=1)[0]
    found = _BLOCK.search(section)
    assert found, f"docs/architecture.md: no Python example under '### {heading}'"
    return found.group(1)
