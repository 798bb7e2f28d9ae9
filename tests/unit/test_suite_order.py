"""The suite's own scheduling rule (tests/conftest.py): files longest first, each kept whole."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.conftest import DURATIONS, UNMEASURED_SECONDS, file_durations, longest_files_first

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Item:
    nodeid: str


def test_files_run_longest_first_and_stay_whole_and_in_order():
    items = [Item(n) for n in (
        "tests/a.py::t1", "tests/a.py::t2", "tests/b.py::t1", "tests/c.py::t1", "tests/b.py::t2",
    )]
    ordered = longest_files_first(items, {"tests/a.py": 5.0, "tests/b.py": 50.0})
    assert [i.nodeid for i in ordered] == [
        "tests/b.py::t1", "tests/b.py::t2",  # 50 s
        "tests/c.py::t1",  # unmeasured: UNMEASURED_SECONDS
        "tests/a.py::t1", "tests/a.py::t2",  # 5 s
    ]
    assert 5.0 < UNMEASURED_SECONDS < 50.0


def test_equal_times_keep_collection_order():
    items = [Item("tests/z.py::t"), Item("tests/y.py::t")]
    assert [i.nodeid for i in longest_files_first(items, {})] == ["tests/z.py::t", "tests/y.py::t"]


def test_the_measured_durations_name_only_files_that_exist():
    durations = file_durations()
    assert durations, f"{DURATIONS} is empty or missing: run scripts/test_durations.py"
    missing = [path for path in durations if not (ROOT / path).is_file()]
    assert not missing, f"stale entries in {DURATIONS.name}: {missing}"
    assert all(seconds >= 0 for seconds in durations.values())
