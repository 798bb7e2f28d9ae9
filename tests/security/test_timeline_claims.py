"""A tiny event log cannot make ``ddpmon timeline`` work for what it claims: a ``start`` event
that claims ten million ranks, or thousands of attempt numbers, is answered with output the
size of what the run dir holds, and a claim beyond it is named as damage.

Run as an operator would: ``ddpmon timeline`` in a subprocess, under an address-space limit
(ten million missing ranks as Python ints would not fit) and a time limit that only a hang
breaks (the reader used to take minutes here; the seconds it takes now are printed, not
judged: speed is the benchmarks' business)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ddpmon.forensics.run_bounds import MAX_MISSING_LISTED, MAX_WORLD_SIZE

REPO = Path(__file__).resolve().parents[2]
LIMIT = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1536 << 20, 1536 << 20))
from ddpmon.cli import main
sys.exit(main(sys.argv[1:]))
"""
HANG = 60.0
"""Seconds only a hang reaches (the claims took minutes before; a second or two now)."""


def timeline(run: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", LIMIT, "timeline", "--no-slurm", *args, str(run)], cwd=REPO,
        capture_output=True, text=True, timeout=HANG,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "120"},
    )
    took = time.monotonic() - t0
    print(f"timeline {' '.join(args)} {run.name}: {took:.2f} s, {len(done.stdout)} bytes out")
    assert "Traceback" not in done.stderr, done.stderr
    return done, took


def write_events(path: Path, events: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for e in events:
            fh.write(json.dumps(e, separators=(",", ":")) + "\n")


def test_a_claim_of_ten_million_ranks_is_damage(tmp_path):
    run = tmp_path / "claims"
    write_events(run / "events.rank0.jsonl", [
        {"ts": 1.0, "rank": 0, "step": None, "kind": "start", "world_size": 10**7},
        {"ts": 2.0, "rank": 0, "step": 1, "kind": "exit", "code": 0},
    ])
    done, _ = timeline(run, "--json")
    assert done.returncode == 0, done.stderr  # not "partial": the claim is not used
    out = json.loads(done.stdout)
    assert out["world_size"] is None and out["missing_ranks"] == [] and not out["partial"]
    assert any("events.rank0.jsonl" in w and "world_size 10000000" in w and
               str(MAX_WORLD_SIZE) in w for w in out["warnings"]), out["warnings"]
    assert len(done.stdout) < 20_000
    text, _ = timeline(run)
    assert text.returncode == 0 and "world_size 10000000" in text.stderr
    assert len(text.stdout) < 20_000


def test_a_large_world_with_few_ranks_lists_a_bounded_number(tmp_path):
    """A claim within the cap is a partial run: every missing rank is counted, the lowest are
    listed (``missing_count`` says how many), and the text folds them into ranges."""
    run = tmp_path / "wide"
    for rank in (0, 5):
        write_events(run / f"events.rank{rank}.jsonl", [
            {"ts": 1.0, "rank": rank, "step": None, "kind": "start", "world_size": MAX_WORLD_SIZE},
            {"ts": 2.0, "rank": rank, "step": 1, "kind": "exit", "code": 0},
        ])
    done, _ = timeline(run, "--json")
    assert done.returncode == 3, done.stderr
    out = json.loads(done.stdout)
    assert out["partial"] and out["missing_count"] == MAX_WORLD_SIZE - 2
    assert len(out["missing_ranks"]) == MAX_MISSING_LISTED
    assert out["missing_ranks"][:6] == [1, 2, 3, 4, 6, 7]
    assert len(done.stdout) < 100_000
    text, _ = timeline(run)
    assert text.returncode == 3
    assert f"1-4, 6-{MAX_MISSING_LISTED + 1}, … ({MAX_WORLD_SIZE - 2} in all)" in text.stdout


def test_attempts_no_start_began_are_damage(tmp_path):
    """5,000 distinct ``attempt`` values and no start event behind them (about 280 KB): one
    damage line, one attempt; the reader used to take seconds per thousand, quadratically."""
    run = tmp_path / "attempts"
    write_events(run / "events.rank0.jsonl",
                 [{"ts": 1.0 + i, "kind": "note", "attempt": i, "step": i} for i in range(5000)])
    done, _ = timeline(run, "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert [a["attempt"] for a in out["attempts"]] == [0]
    assert "events.rank0.jsonl: 5000 event(s) claim an attempt that no start event began; " \
        "counted in the attempt running" in out["warnings"]
    assert len(out["events"]) == 5001  # every line is still shown, with what it claimed
    assert out["events"][-2]["attempt_claimed"] == 4999


def test_five_thousand_started_attempts_read_in_one_pass(tmp_path):
    """5,000 start events, each its own attempt, and a checkpoint: all are in ``--json``, and
    the text shows a bounded excerpt (the attempts' first and last, the table's too)."""
    run = tmp_path / "restarts"
    events = [{"ts": 1.0 + i, "kind": "start", "attempt": i} for i in range(5000)]
    events.append({"ts": 9000.0, "kind": "checkpoint_save", "attempt": 4999, "step": 3})
    events.append({"ts": 9001.0, "kind": "exit", "attempt": 4999, "code": 1, "step": 4})
    write_events(run / "events.rank0.jsonl", events)
    done, _ = timeline(run, "--json")
    out = json.loads(done.stdout)
    assert len(out["attempts"]) == 5000 and out["attempts"][-1]["attempt"] == 4999
    assert out["first_failure"]["kind"] == "exit" and out["first_failure"]["attempt"] == 4999
    assert out["last_good_checkpoint"]["step"] == 3 and out["steps_lost"] == 2
    text, _ = timeline(run)
    lines = text.stdout.splitlines()
    assert "Attempts (5000, one clock):" in text.stdout
    assert "4960 attempts not shown (--json lists them all)" in text.stdout
    assert "events not shown (--json lists them all)" in text.stdout
    assert len(lines) < 1500, len(lines)
    assert "attempt 4999:" in text.stdout and "First failure: rank 0, step 4" in text.stdout


def test_the_daemon_builds_no_timeline_from_huge_event_logs(tmp_path, caplog):
    """The daemon's job verdict builds the timeline on its watcher thread: event logs over
    ``VERDICT_EVENT_BYTES`` (here a 300 MB sparse log beside a real one) are not read at all."""
    from ddpmon.daemon.outcome import VERDICT_EVENT_BYTES, run_verdict

    run = tmp_path / "job"
    write_events(run / "events.rank0.jsonl", [
        {"ts": 1.0, "rank": 0, "step": None, "kind": "start", "world_size": 2},
        {"ts": 2.0, "rank": 0, "step": 3, "kind": "exit", "code": 1},
    ])
    assert run_verdict(run)["layer"] == "process"
    with open(run / "events.rank1.jsonl", "wb") as fh:
        fh.truncate(VERDICT_EVENT_BYTES + (44 << 20))
    assert run_verdict(run) is None
    assert "over" in caplog.text and "event logs hold" in caplog.text
