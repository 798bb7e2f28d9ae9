"""Goodput reads a run dir as hostile: clocks no machine has, durations longer than the run and
fields of the wrong type give a figure over what is usable (or none), never a crash of
``ddpmon timeline``; and the painter tiles its window whatever the intervals claim."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ddpmon.forensics.goodput.paint import Span, paint


def write_events(path, events):
    path.write_text("\n".join(json.dumps(e) for e in events) + "\n")


def test_absurd_claims_give_a_bounded_figure(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    write_events(run / "events.rank0.jsonl", [
        {"kind": "start", "ts": 1e308, "rank": 0, "attempt": 0, "process_start_ts": "x",
         "clock_offset_seconds": 1e308}])
    write_events(run / "events.rank1.jsonl", [
        {"kind": "start", "ts": 100, "rank": 1, "attempt": 0, "process_start_ts": -5e30},
        {"kind": "checkpoint_save", "ts": 105, "rank": 1, "step": "a", "seconds": 1e300},
        {"kind": "phase", "ts": 107, "rank": 1, "seconds": "x"},
        {"kind": "exit", "ts": 109, "rank": 1, "reason": "close"}])
    proc = subprocess.run([sys.executable, "-m", "ddpmon.cli", "timeline", "--no-slurm", "--json",
                           str(run)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    g = json.loads(proc.stdout)["goodput"]
    # the rank-0 clock of 1e308 is no clock: the run is rank 1's 9 s, the save clipped to it
    assert g["wall_seconds"] == pytest.approx(9.0)
    assert sum(g["buckets"].values()) == pytest.approx(9.0)
    assert g["buckets"]["unproductive_checkpoint_save"] == pytest.approx(5.0)
    assert g["buckets"]["custom_badput_events"] == 0


def test_the_painter_tiles_its_window_and_the_higher_priority_wins():
    spans = [Span(1, 4, "data_loading_sync"), Span(2, 3, "unproductive_checkpoint_save"),
             Span(3.5, 6, "productive"), Span(-10, 100, "productive")]
    segs = paint(spans[:3], 0, 8, lambda t: "other", cuts=[7])
    assert segs[0].start == 0 and segs[-1].end == 8
    assert all(a.end == b.start for a, b in zip(segs, segs[1:], strict=False))
    got = {s.bucket: 0.0 for s in segs}
    for s in segs:
        got[s.bucket] += s.end - s.start
    assert got == {"other": 1 + 2, "data_loading_sync": 1 + 0.5,
                   "unproductive_checkpoint_save": 1, "productive": 2.5}
    assert 7 in {s.start for s in segs}  # a cut is a boundary
    assert sum(s.end - s.start for s in paint(spans[3:], 0, 8, lambda t: "other")) == 8


def goodput_of(run) -> dict:
    proc = subprocess.run([sys.executable, "-m", "ddpmon.cli", "timeline", "--no-slurm", "--json",
                           str(run)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["goodput"]


@pytest.mark.parametrize("witness", ["progress", "peers"])
def test_steps_whose_history_rows_were_lost_are_estimated_and_said_so(tmp_path, witness):
    """A rank killed before its journal took its last rows (SIGKILL, a fatal signal): the steps
    its progress file (or, without one, the other ranks' rows) says it completed are still
    counted, timed by estimate, and ``estimated`` names the rank, the attempt and how many."""
    from tests.support.histories import history_bytes, history_run

    run = history_run(tmp_path, "run", steps=20)
    (run / "history.rank1.arrow").write_bytes(history_bytes(15, rank=1))  # rows 15-19 lost
    if witness == "progress":
        (run / "progress.rank1.json").write_text(json.dumps({"step": 19, "ts": 1019.01}))
    g = goodput_of(run)
    said = "its progress file" if witness == "progress" else "the other ranks' rows"
    assert g["estimated"] == [f"rank 1 attempt 0: 5 step(s) after its last history row, counted "
                              f"from {said} (history rows lost, e.g. to a SIGKILL)"]
    assert {r: v["kept_steps"] for r, v in g["ranks"].items()} == {"0": 20, "1": 20}
    assert sum(g["buckets"].values()) == pytest.approx(g["wall_seconds"])


def test_a_complete_history_estimates_nothing(tmp_path):
    from tests.support.histories import history_run

    g = goodput_of(history_run(tmp_path, "run", steps=20))
    assert g["estimated"] == []
    assert {r: v["kept_steps"] for r, v in g["ranks"].items()} == {"0": 20, "1": 20}
