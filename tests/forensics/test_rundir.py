"""RunDir: one name per run-dir file, and the patterns that read each one back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddpmon.forensics.timeline import build_timeline
from ddpmon.recorder.crash import crash_path, sigterm_path
from ddpmon.recorder.eventlog import events_path, progress_path
from ddpmon.recorder.evidence import EvidenceWriter
from ddpmon.recorder.manifest import manifest_path
from ddpmon.recorder.watchdog import flight_recorder_path
from ddpmon.rundir.layout import (
    BUNDLE_RE,
    CRASH_RE,
    EVENTS_RE,
    HISTORY_RE,
    PROGRESS_RE,
    SD_RE,
    SIGTERM_RE,
    SUMMARY_RE,
    RunDir,
    bundle_name,
    parse_bundle_name,
    sd_filename,
)


def test_every_name_reads_back_to_its_rank(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    for make, regex in (
        (run.events, EVENTS_RE),
        (run.progress, PROGRESS_RE),
        (run.summary, SUMMARY_RE),
        (run.crash, CRASH_RE),
        (run.sigterm, SIGTERM_RE),
        (run.history, HISTORY_RE),
    ):
        for rank in (0, 7, 123):
            path = make(rank)
            assert path.parent == tmp_path
            m = regex.match(path.name)
            assert m and int(m.group(1)) == rank, (path.name, regex.pattern)
            # a name of one kind never parses as another
            others = [r for r in (EVENTS_RE, PROGRESS_RE, SUMMARY_RE, CRASH_RE, SIGTERM_RE,
                                  HISTORY_RE) if r is not regex]
            assert not any(r.match(path.name) for r in others)
    assert run.history(3).name == "history.rank3.arrow"
    assert run.manifest() == tmp_path / "manifest.json"


def test_free_functions_are_the_same_names(tmp_path: Path) -> None:
    run = RunDir(str(tmp_path))  # a str is accepted and kept as a Path
    assert isinstance(run.path, Path)
    assert events_path(tmp_path, 2) == run.events(2)
    assert progress_path(tmp_path, 2) == run.progress(2)
    assert crash_path(tmp_path, 2) == run.crash(2)
    assert sigterm_path(tmp_path, 2) == run.sigterm(2)
    assert manifest_path(tmp_path) == run.manifest()
    assert flight_recorder_path(tmp_path, 2) == run.flight_recorder(2)
    assert run.flight_recorder(2) == tmp_path / "flight_recorder" / "fr_trace_rank_2"
    assert run.flight_recorder_json(2).name == "fr_trace_rank_2.json"
    assert RunDir.of(tmp_path, "r1") == RunDir(tmp_path / "r1")


def test_bad_input_is_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rank"):
        RunDir(tmp_path).events(-1)
    with pytest.raises(ValueError, match="run_id"):
        RunDir.of(tmp_path, "a/b")
    with pytest.raises(ValueError, match="run_id"):
        sd_filename("", 0)


def test_sd_filename_matches_its_pattern_and_prometheus_glob() -> None:
    name = sd_filename("demo-20260101-abc", 5)
    assert name == "ddpmon-demo-20260101-abc-rank5.json"
    m = SD_RE.match(name)
    assert m and (m.group(1), int(m.group(2))) == ("demo-20260101-abc", 5)
    assert not name.startswith(".") and name.endswith(".json")


def test_bundle_names_round_trip_and_writer_uses_them(tmp_path: Path) -> None:
    assert parse_bundle_name(bundle_name(3, 17, "non-finite!")) == (3, 17, "non_finite_")
    assert parse_bundle_name(bundle_name(0, None, "stall")) == (0, None, "stall")
    assert parse_bundle_name(".tmp-rank0-123-abcd") is None
    w = EvidenceWriter(tmp_path, 1)
    first = w.write("stall", 4, {"why": "test"})
    second = w.write("stall", 4, {"why": "again"})
    run = RunDir(tmp_path)
    assert first == run.evidence_bundle(1, 4, "stall")
    assert second is not None and second.name == first.name + "-2" and BUNDLE_RE.match(second.name)
    assert run.bundles() == [first, second]


def test_ranked_lists_only_matching_files(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    for rank in (0, 1, 10):
        run.events(rank).write_text("")
    (tmp_path / "events.rankX.jsonl").write_text("")
    (tmp_path / ".events.rank4.jsonl.tmp").write_text("")
    assert run.ranked(EVENTS_RE) == {0: run.events(0), 1: run.events(1), 10: run.events(10)}
    assert RunDir(tmp_path / "missing").ranked(EVENTS_RE) == {}
    assert run.is_run() and not RunDir(tmp_path / "missing").is_run()


def _fr_dump(path: Path, enqueued: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    status = {"0": {"last_enqueued_collective": enqueued, "last_completed_collective": 1}}
    path.write_text(json.dumps({"pg_status": status}))


def test_timeline_reads_the_flight_recorder_in_both_layouts(tmp_path: Path) -> None:
    """New runs dump to flight_recorder/fr_trace_rank_<R>.json; older agents wrote
    flight_recorder.rank<R>.json in the run dir. Both reach the timeline."""
    run = RunDir(tmp_path)
    for rank in (0, 1):
        line = {"ts": 100.0 + rank, "rank": rank, "step": 5, "kind": "stall",
                "idle_seconds": 9.0}
        run.events(rank).write_text(json.dumps(line) + "\n")
    _fr_dump(run.flight_recorder_json(0), 7)  # current layout
    _fr_dump(tmp_path / "flight_recorder.rank1.json", 6)  # legacy layout
    assert sorted(run.flight_recorder_dumps()) == [0, 1]
    tl = build_timeline(tmp_path)
    assert tl.ranks[0]["flight_recorder"]["last_enqueued_collective"] == 7
    assert tl.ranks[1]["flight_recorder"]["last_enqueued_collective"] == 6
    # the rank that enqueued fewer collectives stopped issuing them: it is the hung one
    assert tl.first_failure["rank"] == 1 and tl.first_failure["kind"] == "stall"
