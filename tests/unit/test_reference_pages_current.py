"""The generated reference pages (docs/reference/*.md, docs/index.md from the README) match
their sources, in ``make check``: a README edit without ``make reference`` failed a CI run when
this check ran only in the long lane (tests/docs/test_docs.py holds the rest of the docs
checks, and that each source makes its page stale)."""

from __future__ import annotations

from pathlib import Path

import ddpmon.reference as reference

ROOT = Path(__file__).resolve().parents[2]


def test_generated_pages_are_current():
    diffs = reference.check(ROOT)
    assert not diffs, "stale docs: run `make reference`\n" + "".join(diffs)[:4000]
