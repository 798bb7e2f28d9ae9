"""Write tests/durations.json from pytest JUnit XML reports: each test file's summed test time,
which tests/conftest.py uses to run the longest files first under xdist.

    python scripts/test_durations.py report.xml [more.xml ...]

Take the reports of a fresh-clone ``make test`` (``PYTEST_ARGS=--junitxml=report.xml``); with
several, a file's time is its mean over the reports that ran it.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "durations.json"


def file_of(classname: str) -> str | None:
    """``tests.dir.test_x.TestClass`` -> ``tests/dir/test_x.py`` (when that file exists)."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (ROOT / path).is_file():
            return path
    return None


def summed_times(report: Path) -> dict[str, float]:
    times: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).iter("testcase"):
        path = file_of(case.get("classname", ""))
        if path is not None:
            times[path] += float(case.get("time", "0") or 0)
    return times


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    runs = [summed_times(Path(a)) for a in argv]
    merged: dict[str, list[float]] = defaultdict(list)
    for run in runs:
        for path, seconds in run.items():
            merged[path].append(seconds)
    table = {p: round(sum(v) / len(v), 1) for p, v in merged.items()}
    ordered = dict(sorted(table.items(), key=lambda kv: (-kv[1], kv[0])))
    OUT.write_text(json.dumps(ordered, indent=1) + "\n")
    print(f"{OUT.relative_to(ROOT)}: {len(ordered)} files, {sum(ordered.values()):.0f} s summed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
