"""``ddpmon timeline`` over restarts: attempts apart, the last good checkpoint, steps lost, and
the state a resume did not restore. Run dirs are written with the agent's own writers."""

from __future__ import annotations

import json
import subprocess
import sys

from ddpmon.forensics.timeline import build_timeline
from ddpmon.recorder.eventlog import EventLog, ProgressFile
from ddpmon.recorder.manifest import previous_attempts, recovery_gaps
from ddpmon.rundir.layout import RunDir


def write_attempt(rd: RunDir, attempt: int, last_steps: dict[int, int], saves: dict[int, list],
                  load: dict | None, killed: int | None, previous: dict | None = None) -> None:
    """One attempt of a 2-rank run: saves[rank] = checkpoint steps, rank ``killed`` vanishes."""
    for rank in (0, 1):
        log, prog = EventLog(rd.path, rank), ProgressFile(rd.path, rank)
        log.emit("start", None, world_size=2, attempt=attempt, clock_offset_seconds=0.0,
                 previous_progress=(previous or {}).get(rank))
        if load is not None:
            log.emit("checkpoint_load", load["step"], ok=True, attempt=attempt, path="ck",
                     restored=load["restored"], not_restored=load["not_restored"], not_stated=[])
        first = load["step"] if load else 0
        for step in range(first, last_steps[rank] + 1):
            prog.update(step)
            if step + 1 in saves.get(rank, []):
                log.emit("checkpoint_save", step + 1, ok=True, attempt=attempt,
                         path=f"ck/step-{step + 1}.pt")
        if rank != killed:
            log.emit("exit", last_steps[rank], reason="close", attempt=attempt)
        log.close()
        prog.close()


def test_kill_at_35_restart_from_30_loses_5_steps(tmp_path):
    rd = RunDir(tmp_path / "run")
    write_attempt(rd, 0, {0: 34, 1: 34}, {0: [10, 20, 30]}, None, killed=1)
    prev = {r: json.loads(rd.progress(r).read_text()) for r in (0, 1)}
    write_attempt(rd, 1, {0: 59, 1: 59}, {0: [40, 50, 60]},
                  {"step": 30, "restored": ["model", "optimizer"], "not_restored": ["rng"]},
                  killed=None, previous=prev)
    tl = build_timeline(rd.path).to_json()
    ff = tl["first_failure"]
    assert (ff["rank"], ff["kind"], ff["step"], ff["attempt"]) == (1, "vanished", 34, 0)
    assert [a["attempt"] for a in tl["attempts"]] == [0, 1]
    assert [a["last_step"] for a in tl["attempts"]] == [34, 59]
    assert tl["last_good_checkpoint"]["step"] == 30
    assert tl["steps_lost"] == 5
    assert tl["restarted"]["resumed_from"]["missing"] == ["rng"]
    assert {e["attempt"] for e in tl["events"] if e["kind"] == "vanished"} == {0}
    out = subprocess.run([sys.executable, "-m", "ddpmon.cli", "timeline", str(rd.path)],
                         capture_output=True, text=True, timeout=60, env={"COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "a restart from it loses 5 step(s)" in out.stdout
    assert "state not restored: rng" in out.stdout


def test_a_step_only_some_savers_finished_is_not_good(tmp_path):
    rd = RunDir(tmp_path / "run")
    # both ranks save their shard; rank 1 died at step 29, before its save of step 30
    write_attempt(rd, 0, {0: 32, 1: 28}, {0: [10, 20, 30], 1: [10, 20]}, None, killed=1)
    tl = build_timeline(rd.path).to_json()
    assert tl["last_good_checkpoint"]["step"] == 20
    assert tl["last_good_checkpoint"]["ranks"] == [0, 1]
    assert tl["steps_lost"] == 33 - 20


def test_no_checkpoint_loses_every_step_and_a_clean_run_has_no_loss(tmp_path):
    rd = RunDir(tmp_path / "failed")
    write_attempt(rd, 0, {0: 11, 1: 11}, {}, None, killed=0)
    tl = build_timeline(rd.path).to_json()
    assert tl["last_good_checkpoint"] is None and tl["steps_lost"] == 12
    clean = RunDir(tmp_path / "clean")
    write_attempt(clean, 0, {0: 9, 1: 9}, {0: [10]}, None, killed=None)
    tl = build_timeline(clean.path).to_json()
    assert tl["first_failure"] is None and "steps_lost" not in tl
    assert len(tl["attempts"]) == 1


def test_manifest_keeps_earlier_attempts_and_names_gaps(tmp_path):
    rd = RunDir(tmp_path)
    rd.manifest().write_text(json.dumps({"attempt": 0, "created": 1.0, "recovery": None,
                                         "launch": {"argv": ["train.py"]}}))
    kept = previous_attempts(rd.path, 1)
    assert kept == [{"attempt": 0, "created": 1.0, "recovery": None,
                     "launch": {"argv": ["train.py"], "torchelastic": None}}]
    assert previous_attempts(rd.path, 0) == []
    gaps = recovery_gaps({"recovery": {"not_restored": ["rng"], "not_stated": ["data_loader"]}})
    assert gaps == ["rng", "data_loader"]
    assert recovery_gaps({"recovery": None}) == []
