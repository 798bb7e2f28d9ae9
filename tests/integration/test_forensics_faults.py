"""Injected faults in a real 2-rank demo run (torchrun, gloo, CPU), explained by the forensics:
``ddpmon timeline --json`` must name rank 1 first, with the right kind and tensor or signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ddpmon.demo.faults import DEFAULT_PARAM
from ddpmon.recorder.evidence import read_bundle
from tests.support.demo import DemoRun

REPO = Path(__file__).resolve().parents[2]
FAULT_STEP = 6


def timeline(run_path: Path) -> tuple[int, dict]:
    res = subprocess.run(
        [sys.executable, "-m", "ddpmon.cli", "timeline", str(run_path), "--json"],
        capture_output=True, text=True, timeout=60, cwd=str(REPO),
    )
    return res.returncode, json.loads(res.stdout)


def wait_for(predicate, timeout: float, what: str, demo: DemoRun):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        demo.track()
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; demo log:\n{demo.log_tail()}")


def demo(tmp_path: Path, run_id: str, injects: list[str], steps: int = 400) -> DemoRun:
    return DemoRun(
        workdir=tmp_path, sd_dir=tmp_path / "sd", steps=steps, step_delay=0.05,
        injects=injects, run_id=run_id, env={"DDPMON_STALL_SECONDS": "3"},
        linger=0,  # no store scrapes these runs: the ranks need not wait for one
    )


def test_nan_on_rank1_is_named_with_its_parameter(tmp_path):
    with demo(tmp_path, "nan", [f"nan@rank1:step{FAULT_STEP}"], steps=FAULT_STEP + 4) as run:
        assert run.wait(timeout=150) == 0, run.log_tail()
        code, tl = timeline(run.run_path)
    assert code == 0
    ff = tl["first_failure"]
    assert (ff["rank"], ff["step"], ff["kind"]) == (1, FAULT_STEP, "nonfinite"), ff
    assert ff["param"] == DEFAULT_PARAM and ff["nonfinite"] == "nan"
    # Rank 0 saw the NaN too, but only after the all-reduce: a consequence, not the origin.
    r0 = [e for e in tl["events"] if e["rank"] == 0 and e["kind"] == "nonfinite"]
    assert r0 and all(e["origin"] is False for e in r0)
    bundle = run.run_path / "evidence" / f"rank1-step{FAULT_STEP}-nonfinite"
    info = read_bundle(bundle)
    assert info["info"]["param"] == DEFAULT_PARAM
    (summary,) = info["tensors"].values()
    assert summary["nan"] >= 1 and summary["finite"] > 0 and summary["shape"] == [256, 64]
    assert info["records"] and info["extra"]["scaler"] is not None
    assert not (bundle / "inputs").exists()
    assert tl["ranks"]["0"]["ended"] == "closed (mon.close)"  # a clean end, not vanished


def test_segv_on_rank1_is_named_with_the_signal(tmp_path):
    with demo(tmp_path, "segv", [f"segv@rank1:step{FAULT_STEP}"]) as run:
        assert run.wait(timeout=150) != 0
        code, tl = timeline(run.run_path)
    ff = tl["first_failure"]
    assert (ff["rank"], ff["kind"], ff["signal"], ff["signum"]) == (1, "signal", "SIGSEGV", 11)
    crash = (run.run_path / "crash.rank1.txt").read_text()
    assert "Fatal Python error: Segmentation fault" in crash and "before_backward" in crash
    assert tl["ranks"]["1"]["ended"] == "signal SIGSEGV"
    assert not tl["ranks"]["0"]["ended"].startswith("vanished"), tl["ranks"]["0"]


def test_rank1_sigkilled_from_outside_is_named_vanished(tmp_path):
    with demo(tmp_path, "kill", []) as run:
        wait_for(lambda: len(run.rank_pids()) == 2 and run.events(1), 120, "both ranks", run)
        # a few steps in, whatever the machine's load: rank 1 has completed step 3
        wait_for(lambda: (run.progress_step(1) or 0) >= 3, 120, "rank 1 at step 3", run)
        os.kill(run.rank_pids()[1], signal.SIGKILL)
        assert run.wait(timeout=120) != 0
        code, tl = timeline(run.run_path)
    ff = tl["first_failure"]
    assert (ff["rank"], ff["kind"]) == (1, "vanished"), ff
    assert tl["ranks"]["1"]["ended"].startswith("vanished")
    assert not tl["ranks"]["0"]["ended"].startswith("vanished"), tl["ranks"]["0"]


def test_rank1_hang_is_named_and_survivor_stall_recorded(tmp_path):
    with demo(tmp_path, "hang", [f"hang@rank1:step{FAULT_STEP}"]) as run:
        def stalled():
            return all(any(e["kind"] == "stall" for e in run.events(r)) for r in (0, 1))

        wait_for(stalled, 150, "stall events on both ranks", run)
        wait_for(lambda: len(list(run.run_path.glob("*flight_recorder*"))) >= 2 or list(
            (run.run_path / "flight_recorder").glob("*.json")), 30, "flight recorder", run)
        code, tl = timeline(run.run_path)
        assert run.proc.poll() is None  # the watchdog left the processes running
    ff = tl["first_failure"]
    assert (ff["rank"], ff["kind"]) == (1, "stall"), (ff, tl["ranks"])
    assert ff["step"] == FAULT_STEP
    fr = {r: tl["ranks"][r].get("flight_recorder") for r in ("0", "1")}
    assert fr["0"]["last_enqueued_collective"] > fr["1"]["last_enqueued_collective"], fr
    for rank in (0, 1):
        (bundle,) = (run.run_path / "evidence").glob(f"rank{rank}-step*-stall")
        info = read_bundle(bundle)
        assert info["info"]["idle_seconds"] >= 3
        stacks = (bundle / "stacks.txt").read_text()
        assert "ddpmon-watchdog" in stacks
        if rank == 1:
            assert "before_backward" in stacks  # where the hung rank sits
