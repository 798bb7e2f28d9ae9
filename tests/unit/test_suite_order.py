"""The suite's own scheduling rules (tests/conftest.py): files longest first, each kept whole;
a lane's ``-m`` leaves the files of other lanes uncollected."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.conftest import (
    DURATIONS,
    UNMEASURED_SECONDS,
    file_durations,
    lane_deselects,
    longest_files_first,
    pytest_ignore_collect,
)

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


FAST = "not ranks and not services and not browser and not gpu"


def test_a_lane_expression_judges_a_file_by_its_lane_markers():
    assert lane_deselects(FAST, ("ranks",))
    assert lane_deselects(FAST, ("ranks", "services"))
    assert not lane_deselects(FAST, ())
    assert lane_deselects("ranks", ())
    assert not lane_deselects("ranks", ("ranks", "services"))
    assert lane_deselects("(ranks or services) and not browser", ("ranks", "browser"))
    assert not lane_deselects("not (ranks and services)", ("ranks",))


def test_an_expression_naming_other_markers_or_malformed_collects_everything():
    assert not lane_deselects("timeout and not ranks", ("ranks",))  # another marker: collect
    assert not lane_deselects("ranks and", ())  # pytest reports the syntax error itself
    assert not lane_deselects("__import__", ())
    assert not lane_deselects("", ("ranks",))


@dataclass
class Options:
    markexpr: str

    def getoption(self, name: str, default=None):
        return getattr(self, name, default)


def test_the_fast_lane_leaves_a_ranks_file_uncollected_and_keeps_its_own():
    """Under the fast lane's -m a ranks file is not even imported; a unit file and a directory
    are collected, and without -m everything is."""
    tests = ROOT / "tests"
    fast, whole = Options(FAST), Options("")
    assert pytest_ignore_collect(tests / "parallel" / "test_attach.py", fast) is True
    assert pytest_ignore_collect(tests / "parallel" / "test_row_chunks.py", fast) is None
    assert pytest_ignore_collect(tests / "unit" / "test_suite_order.py", fast) is None
    assert pytest_ignore_collect(tests / "parallel", fast) is None
    assert pytest_ignore_collect(tests / "parallel" / "test_attach.py", whole) is None
