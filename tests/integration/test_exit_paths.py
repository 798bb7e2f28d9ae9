"""The step that never finishes: two real gloo ranks run a DDP loop as public scripts write it
(``exits_worker.py``), rank 1 fails at step 10 after steps 0-9 completed, and ``ddpmon timeline
--json`` must name rank 1 and step 10 first, by evidence, with the right layer, the origin tensor
where there is one and the user's frame for a data error. The step is checked against the
script's own record of where it was."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ddpmon.recorder.history_read import read_history
from tests.support.ranks import start_ranks

WORKER = Path(__file__).with_name("exits_worker.py")
REPO = Path(__file__).resolve().parents[2]
AT = 10


def run(tmp_path: Path, fault: str, *extra: str) -> tuple[list, list[dict], dict]:
    """Both ranks' exit codes, the script's own notes per rank, and the timeline's JSON."""
    cmd = [sys.executable, str(WORKER), "--out", str(tmp_path), "--fault", fault,
           "--at", str(AT), *extra]
    outputs = start_ranks(cmd, 2, 180, None)
    notes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    run_id = fault + ("-fsdp" if "--fsdp" in extra else "")
    res = subprocess.run(
        [sys.executable, "-m", "ddpmon.cli", "timeline", str(tmp_path / "runs" / run_id),
         "--json"], capture_output=True, text=True, timeout=60, cwd=str(REPO),
    )
    assert res.stdout, res.stderr
    return [o.code for o in outputs], notes, json.loads(res.stdout)


def failed_at_step_10(codes: list, notes: list[dict], tl: dict) -> dict:
    """Rank 1 failed during step 10 after completing steps 0-9 (the script's own count), and
    the timeline names it first at that step; returns the first failure."""
    assert codes[1] != 0, codes
    assert notes[1]["completed"] == AT, notes[1]
    ff = tl["first_failure"]
    assert (ff["rank"], ff["step"]) == (1, AT), (ff, tl["verdict"])
    assert ff["running"] is True  # the step in flight, not a completed one
    # the survivor lost its peer in step 10's all-reduce: a consequence, never first
    r0 = [e for e in tl["events"] if e["rank"] == 0 and e["kind"] == "exit"
          and e.get("reason") == "exception"]
    assert r0 and all(e["step"] == AT for e in r0), r0
    # the last completed step is still 9 (the step in flight does not count as completed)
    assert tl["ranks"]["1"]["last_step"] == AT - 1, tl["ranks"]["1"]
    return ff


def test_clip_error_names_the_rank_whose_gradients_went_nan_not_the_first_to_raise(tmp_path):
    codes, notes, tl = run(tmp_path, "clip", "--late", "0.5")
    assert codes == [1, 1], codes
    ff = tl["first_failure"]
    assert (ff["rank"], ff["step"], ff["kind"], ff["class"]) == (1, AT, "nonfinite", "origin"), ff
    assert ff["origin"] is True and ff["nonfinite"] == "nan" and ff["running"] is True
    assert ff["param"] in notes[1]["params"], ff
    assert tl["verdict"]["layer"] == "numerics" and ff["param"] in tl["verdict"]["evidence"]
    exits = {e["rank"]: e for e in tl["events"]
             if e["kind"] == "exit" and e.get("reason") == "exception"}
    # both raised torch's clip error; rank 0 wrote its exception first (rank 1 was slower)
    assert exits[0]["t"] < exits[1]["t"], exits
    for rank in (0, 1):
        assert exits[rank]["step"] == AT and exits[rank]["cause"] == "numerics"
        assert "non-finite, so it cannot be clipped" in exits[rank]["message"]
    r0 = [e for e in tl["events"] if e["rank"] == 0 and e["kind"] == "nonfinite"]
    assert r0 and all(e["origin"] is False and e["step"] == AT for e in r0), r0
    assert (tmp_path / "runs" / "clip" / "evidence" / f"rank1-step{AT}-nonfinite").is_dir()
    assert tl["ranks"]["1"]["last_step"] == AT - 1


def test_clip_error_under_fsdp2_names_the_reduce_scatter_inputs_origin(tmp_path):
    codes, notes, tl = run(tmp_path, "clip", "--fsdp", "--late", "0.5")
    assert codes == [1, 1], codes
    ff = tl["first_failure"]
    assert (ff["rank"], ff["step"], ff["kind"], ff["origin"]) == (1, AT, "nonfinite", True), ff
    assert ff["param"] in notes[1]["params"] and ff["running"] is True
    exits = {e["rank"]: e for e in tl["events"]
             if e["kind"] == "exit" and e.get("reason") == "exception"}
    assert exits[0]["t"] < exits[1]["t"] and exits[0]["cause"] == "numerics", exits
    assert tl["verdict"]["layer"] == "numerics"


def test_loss_guard_is_numerics_on_rank_1(tmp_path):
    codes, notes, tl = run(tmp_path, "guard")
    ff = failed_at_step_10(codes, notes, tl)
    assert notes[1]["loss_nan_at"] == AT and notes[0]["loss_nan_at"] is None
    assert (ff["kind"], ff["exc_type"], ff["cause"]) == ("exit", "RuntimeError", "numerics"), ff
    assert ff["message"].startswith("Loss is nan")
    assert tl["verdict"]["layer"] == "numerics", tl["verdict"]


def test_dataset_error_is_data_with_the_datasets_frame(tmp_path):
    codes, notes, tl = run(tmp_path, "dataset")
    ff = failed_at_step_10(codes, notes, tl)
    assert notes[1]["started"] == AT - 1  # the loader raised fetching step 10's batch
    line = next(i for i, text in enumerate(WORKER.read_text().splitlines(), 1)
                if "# DATA-FAULT" in text)
    assert (ff["kind"], ff["exc_type"], ff["cause"]) == ("exit", "ValueError", "data"), ff
    assert ff["frame"] == f"__getitem__ ({WORKER}:{line})", ff
    assert ff["phase"] == "before its forward"
    assert tl["verdict"]["layer"] == "data" and "__getitem__" in tl["verdict"]["evidence"]


def test_out_of_memory_in_forward_is_memory(tmp_path):
    codes, notes, tl = run(tmp_path, "oom")
    ff = failed_at_step_10(codes, notes, tl)
    assert notes[1]["started"] == AT
    assert (ff["kind"], ff["exc_type"], ff["cause"]) == ("exit", "OutOfMemoryError", "memory")
    assert tl["verdict"]["layer"] == "memory", tl["verdict"]


def test_sigterm_is_the_process_stopped_not_a_communication_fault(tmp_path):
    codes, notes, tl = run(tmp_path, "sigterm")
    assert codes[1] == -15, codes
    ff = failed_at_step_10(codes, notes, tl)
    assert notes[1]["started"] == AT
    assert (ff["kind"], ff["signal"]) == ("signal", "SIGTERM"), ff
    assert ff["frame"].startswith("forward (") and ff["phase"] == "in forward or backward"
    assert tl["verdict"]["layer"] == "process", tl["verdict"]
    assert "stopped" in tl["verdict"]["evidence"]
    # the steps it completed reached its history before it died (term_flush), all 10 in its
    # first second, which the history journal's 1 s flush alone would have lost
    history = read_history(tmp_path / "runs" / "sigterm" / "history.rank1.arrow")
    assert [int(s) for s in history.columns["step"]] == list(range(AT))


def test_sigkill_is_named_at_the_step_in_flight(tmp_path):
    codes, notes, tl = run(tmp_path, "sigkill")
    assert codes[1] == -9, codes
    ff = failed_at_step_10(codes, notes, tl)
    assert notes[1]["started"] == AT
    assert (ff["kind"], ff["phase"]) == ("vanished", "in forward or backward"), ff


def test_a_loop_that_skips_the_step_itself_goes_on(tmp_path):
    codes, notes, tl = run(tmp_path, "skip")
    assert codes == [0, 0], codes
    steps = 14
    for note in notes:
        assert note["skipped"] == [AT] and note["completed"] == steps - 1, note
    ff = tl["first_failure"]
    assert (ff["rank"], ff["step"], ff["kind"], ff["origin"]) == (1, AT, "nonfinite", True), ff
    assert "running" not in ff  # a completed (skipped) step, read as before
    skipped = sorted(e["rank"] for e in tl["events"] if e["kind"] == "step_skipped")
    assert skipped == [0, 1]
    assert not [e for e in tl["events"] if e["kind"] == "exit" and e.get("reason") == "exception"]
    assert {tl["ranks"][r]["ended"] for r in ("0", "1")} == {"closed (mon.close)"}
