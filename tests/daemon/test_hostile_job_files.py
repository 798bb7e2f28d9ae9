"""A job's files are the job's: whatever a run dir holds, the daemon's job finish and its
startup recovery end the job's record with an outcome and never raise (a raise left the record
RUNNING for ever, and at startup made the daemon exit). Events of another shape, a line nested
past the parser's recursion, a line of several MB, a FIFO in place of an event log and a
nested result file are each skipped as damage; the valid failure beside them is still found."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ddpmon.daemon import outcome
from ddpmon.daemon import summary as outcome_summary
from ddpmon.daemon.jobs import JobManager
from ddpmon.daemon.settings import DaemonSettings
from ddpmon.daemon.store import JobRecord, Store
from ddpmon.rundir.safe_read import BadLine, json_lines, load_json

NESTED = b"[" * 200_000 + b"]" * 200_000
SEGV = {"kind": "signal", "rank": 1, "ts": 1000.0, "signal": "SIGSEGV", "step": 7}


def hostile_run(run: Path) -> None:
    run.mkdir(parents=True)
    lines = [
        b'{"kind": []}',  # unhashable kind
        b'{"kind": {"a": 1}, "ts": [1]}',
        NESTED,  # RecursionError in json.loads
        b'{"kind": "exit", "code": "' + b"x" * 3_000_000 + b'"}',  # one huge line
        b"\xff\xfe not utf-8",
        json.dumps(SEGV).encode(),
    ]
    (run / "events.rank1.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    os.mkfifo(run / "events.rank0.jsonl")  # a reader that opens it blocking would hang


def test_readers_skip_what_they_cannot_read(tmp_path):
    hostile_run(tmp_path / "run")
    found = list(json_lines(tmp_path / "run" / "events.rank1.jsonl"))
    bad = [f for f in found if isinstance(f, BadLine)]
    assert [(b.number, b.problem) for b in bad[:2]] == [
        (3, "nested too deeply"), (4, "line over 1048576 bytes")
    ]
    assert len(bad) == 3 and bad[2].number == 5  # not UTF-8
    assert found[-1] == SEGV
    with pytest.raises(OSError, match="not a regular file"):
        list(json_lines(tmp_path / "run" / "events.rank0.jsonl"))
    (tmp_path / "result.json").write_bytes(NESTED)
    with pytest.raises(ValueError, match="nested too deeply"):
        load_json(tmp_path / "result.json")
    assert outcome.read_result(tmp_path / "result.json") is None


def test_the_first_failure_is_found_beside_the_damage(tmp_path):
    hostile_run(tmp_path / "run")
    failures = outcome.event_failures(tmp_path / "run")
    assert [(f["rank"], f["kind"], f["signal"]) for f in failures] == [(1, "signal", 11)]


def test_startup_recovery_ends_the_job_and_the_daemon_starts(tmp_path):
    state = tmp_path / "state"
    runs = state / "runs"
    hostile_run(runs / "j1")
    job_dir = state / "jobs" / "j1"
    job_dir.mkdir(parents=True)
    (job_dir / "result.json").write_bytes(NESTED)
    store = Store(state / "ddpmon.sqlite3")
    job = JobRecord(id="j1", entrypoint="demo", nproc=2, state="RUNNING", pid=None,
                    pid_create_time=1.0, job_dir=str(job_dir), run_dir=str(runs))
    store.insert_job(job)
    manager = JobManager(store, DaemonSettings(), state)
    manager.recover()  # must not raise
    ended = store.get_job("j1")
    assert ended.state == "LOST", ended
    assert ended.first_failure is not None and ended.first_failure["signal"] == 11


def test_a_finished_jobs_summary_takes_the_ranks_final_files(tmp_path):
    """Scrapes can miss the last step (a rank closes right after it); the final summary files
    cannot. A damaged or odd file beside them leaves the scraped values as they were."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.rank0.json").write_text(json.dumps(
        {"last_step": 15, "loss": 0.5, "grad_norm": 0.25, "steps": 16, "loss_scale": None}))
    (run / "summary.rank1.json").write_bytes(NESTED)
    (run / "summary.rank2.json").write_text("[1, 2]")
    os.mkfifo(run / "summary.rank3.json")
    scraped = {"ranks": {"0": {"step": 14.0, "loss": 0.6}, "1": {"step": 14.0}},
               "min_step": 14.0, "max_step": 14.0, "scrapes_ok": 9}
    final = outcome_summary.merge_final(scraped, run)
    assert final["max_step"] == 15 and final["min_step"] == 14, final
    assert final["ranks"]["0"] == {"step": 15.0, "loss": 0.5, "grad_norm": 0.25,
                                   "steps_total": 16.0, "final": True}
    assert final["ranks"]["1"] == {"step": 14.0} and final["scrapes_ok"] == 9
    assert outcome_summary.merge_final(scraped, tmp_path / "nowhere") == scraped
