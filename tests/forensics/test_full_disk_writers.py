"""The run-dir writers on a real full disk (a small tmpfs filled up, then freed): nothing raises,
failures are counted once per rank in one line, files stay whole, writing resumes, and the
resume leaves a ``write_gap`` event with what was lost."""

from __future__ import annotations

import json
import logging
import time

import pytest

from ddpmon.agent.guard import Guard
from ddpmon.recorder.eventlog import EventLog, read_events
from ddpmon.recorder.evidence import EvidenceWriter
from ddpmon.rundir.atomic import write_json_atomic
from ddpmon.rundir.writes import WriteHealth
from tests.support.tmpfs import small_tmpfs


class Counter:
    """A real ``count(probe)`` target, like ``MetricState.count_error``."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def __call__(self, probe: str) -> None:
        self.counts[probe] = self.counts.get(probe, 0) + 1


def leftovers(root) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.name.endswith(".tmp") or p.name.startswith(".tmp")]


def test_one_line_per_episode_and_a_gap_event_naming_what_was_lost(caplog):
    counter, events = Counter(), []
    health = WriteHealth(counter)
    health.connect(rank=3, run_path="/runs/x", emit=lambda k, s, **f: events.append((k, s, f)))
    full = OSError(28, "No space left on device")
    with caplog.at_level(logging.WARNING, logger="ddpmon"):
        health.failed("eventlog", full, lost=1, steps=(7,))
        health.failed("history", full, lost=0, steps=(5, 9))
        health.failed("eventlog", full, lost=1, steps=(12,))
        health.succeeded("progress")  # never failed in this episode: the gap goes on
        assert health.failing and not events
        health.succeeded("history")  # its kept rows landed: the episode is over
        health.succeeded("eventlog")  # nothing more
    assert counter.counts == {"eventlog": 2, "history": 1}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "rank 3 run dir /runs/x: writes fail" in lines[0] and "No space left" in lines[0]
    assert "writes resume" in lines[1] and "steps 5-12" in lines[1]
    [(kind, step, fields)] = events
    assert kind == "write_gap" and step == 12
    assert fields["lost"] == {"eventlog": 2, "history": 0}
    assert fields["failures"] == {"eventlog": 2, "history": 1}
    assert (fields["first_step"], fields["last_step"]) == (5, 12)
    assert fields["resumed_by"] == "history" and fields["seconds"] >= 0
    assert "lost: eventlog 2" in fields["detail"]


def test_an_episode_also_ends_when_a_writer_that_retries_writes_again():
    events = []
    health = WriteHealth(Counter())
    health.connect(rank=0, run_path="/runs/x", emit=lambda k, s, **f: events.append(f))
    full = OSError(28, "No space left on device")
    health.failed("evidence", full, steps=(3,))  # opens it; bundles are rare: may never retry
    health.failed("eventlog", full, steps=(4,))  # a line lost
    health.failed("history", full, lost=0, steps=(4,))  # rows kept, to write again
    health.succeeded("eventlog")  # a short line may fit a page the log already holds
    assert health.failing and not events
    health.succeeded("history")  # its kept rows landed: space is back
    [fields] = events
    assert fields["resumed_by"] == "history" and not health.failing


def test_event_log_keeps_whole_lines_on_a_full_disk_and_records_the_gap(tmp_path, caplog):
    with small_tmpfs(tmp_path / "disk", "256k") as disk:
        counter = Counter()
        health = WriteHealth(counter)
        log = EventLog(disk.path, 0, health=health)
        health.connect(rank=0, run_path=disk.path, emit=log.emit)
        log.emit("start", None)
        disk.fill()
        with caplog.at_level(logging.WARNING, logger="ddpmon"):
            for step in range(40):  # ~200 bytes each: the last page fills, then writes fail
                log.emit("overflow", step, loss_scale=2.0**step, note="x" * 120)
            full_events, bad = read_events(log.path)
            assert bad == 0 and full_events[0]["kind"] == "start"
            lost = 41 - len(full_events)
            assert lost > 0 and counter.counts["eventlog"] == lost
            disk.free()
            log.emit("overflow", 99)
        log.close()
        events, bad = read_events(log.path)
        assert bad == 0
        assert [e["kind"] for e in events[-2:]] == ["overflow", "write_gap"]
        gap = events[-1]
        assert gap["lost"] == {"eventlog": lost} and gap["last_step"] == 39
        assert gap["first_step"] == 40 - lost
        assert len(caplog.records) == 2  # failing, resumed: not one line per lost event


def _history_blocks(disk) -> int:
    """Blocks allocated to the history's files (main file and journal)."""
    files = list(disk.path.glob("history.rank0*.arrow"))
    assert files, "no history file"
    return sum(p.stat().st_blocks for p in files)


def test_history_journal_stays_readable_and_rows_wait_for_space(tmp_path):
    pytest.importorskip("pyarrow")
    from ddpmon.recorder.history import HistoryWriter, row_of
    from ddpmon.recorder.history_read import read_history
    from tests.forensics.test_history import GROUPS, record

    with small_tmpfs(tmp_path / "disk", "512k") as disk:
        counter = Counter()
        health = WriteHealth(counter)
        path = disk.path / "history.rank0.arrow"
        w = HistoryWriter(path, GROUPS, flush_seconds=0.02, seal_rows=100_000, health=health)
        try:
            for step in range(50):
                w.put(row_of(record(step), GROUPS, 1))
            wait_for(lambda: rows(path) == 50)
            disk.fill()
            blocks_when_full = _history_blocks(disk)
            for step in range(50, 400):
                w.put(row_of(record(step), GROUPS, 1))
                if step % 50 == 0:
                    time.sleep(0.05)
            wait_for(lambda: counter.counts.get("history", 0) >= 3)
            during = read_history(path)
            # (a write being cut back may be seen as a torn tail: the rows before it are whole)
            # Rows that fit in the file's last, already allocated page may still land (how many
            # depends on the row size); none takes new space while the disk is full.
            steps = list(during.columns["step"])
            assert steps[:50] == list(range(50)) and steps == list(range(len(steps)))
            assert _history_blocks(disk) == blocks_when_full
            disk.free()
            wait_for(lambda: not health.failing)
        finally:
            w.close()
        after = read_history(path)
        assert not after.torn and list(after.columns["step"]) == list(range(400))
        assert w.rows_lost == 0 and not leftovers(disk.path)


def test_history_drops_rows_beyond_its_bound_and_counts_them(tmp_path):
    pytest.importorskip("pyarrow")
    from ddpmon.recorder.history import HistoryWriter, row_of
    from ddpmon.recorder.history_read import read_history
    from tests.forensics.test_history import GROUPS, record

    events: list = []
    with small_tmpfs(tmp_path / "disk", "256k") as disk:
        health = WriteHealth(Counter())
        health.connect(rank=0, run_path=disk.path, emit=lambda k, s, **f: events.append(f))
        path = disk.path / "history.rank0.arrow"
        disk.fill()
        w = HistoryWriter(path, GROUPS, flush_seconds=0.02, max_pending=100, health=health)
        try:
            for step in range(300):
                w.put(row_of(record(step), GROUPS, 1))
            wait_for(lambda: w.rows_lost == 200 and health.failing)
            time.sleep(0.1)  # one more failed flush reports the drops
            disk.free()
            wait_for(lambda: not health.failing)
        finally:
            w.close()
        assert list(read_history(path).columns["step"]) == list(range(100))
    [gap] = events
    assert gap["lost"] == {"history": 200} and (gap["first_step"], gap["last_step"]) == (0, 299)


def test_evidence_and_atomic_files_leave_nothing_half_written(tmp_path, caplog):
    with small_tmpfs(tmp_path / "disk", "256k") as disk:
        counter = Counter()
        guard = Guard(counter)
        evidence = EvidenceWriter(disk.path, 1, health=guard.writes)
        disk.fill()
        with caplog.at_level(logging.WARNING, logger="ddpmon"):
            assert evidence.write("nonfinite", 5, {"param": "w"}, records=[{"x": 1}] * 50) is None
            with guard("summary"):
                write_json_atomic(disk.path / "summary.rank1.json", {"pad": "y" * 20_000})
        assert counter.counts == {"evidence": 1, "summary": 1}
        assert len(caplog.records) == 1  # one line for the rank, not one per writer
        assert not leftovers(disk.path) and not (disk.path / "summary.rank1.json").exists()
        assert not any((disk.path / "evidence").iterdir())
        disk.free()
        assert evidence.write("nonfinite", 6, {"param": "w"}) is not None
        assert not guard.writes.failing
        bundle = next((disk.path / "evidence").iterdir())
        assert json.loads((bundle / "info.json").read_text())["step"] == 6


def rows(path) -> int:
    """Rows readable now (0 while the first batch is still being written)."""
    from ddpmon.recorder.history_read import read_history

    try:
        return len(read_history(path))
    except (FileNotFoundError, ValueError):
        return 0


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def test_history_closed_on_a_full_disk_keeps_its_journal_and_counts_the_rest(tmp_path):
    pytest.importorskip("pyarrow")
    from ddpmon.recorder.history import HistoryWriter, journal_path, row_of
    from tests.forensics.test_history import GROUPS, record

    with small_tmpfs(tmp_path / "disk", "256k") as disk:
        health = WriteHealth(Counter())
        path = disk.path / "history.rank0.arrow"
        w = HistoryWriter(path, GROUPS, flush_seconds=0.02, health=health)
        for step in range(20):
            w.put(row_of(record(step), GROUPS, 1))
        wait_for(lambda: rows(path) == 20)
        disk.fill()
        for step in range(20, 30):
            w.put(row_of(record(step), GROUPS, 1))
        w.close()  # the final seal fails: the journal's rows stay, the rest are lost
        assert health.failing and journal_path(path).exists()
        assert rows(path) == 20 and w.rows_lost == 10
