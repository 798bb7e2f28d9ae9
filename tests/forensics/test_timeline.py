import json
import os

from ddpmon.cli import main
from ddpmon.forensics.timeline import build_timeline
from ddpmon.recorder.eventlog import EventLog


def _write(run, rank, events):
    """Events with explicit ts (rank-local clock), as the agent would have written them."""
    run.mkdir(parents=True, exist_ok=True)
    with open(run / f"events.rank{rank}.jsonl", "a") as fh:
        for e in events:
            fh.write(json.dumps({"rank": rank, "step": None, **e}) + "\n")


def _json(capsys, *argv):
    capsys.readouterr()
    code = main(["timeline", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_offsets_order_events_on_rank0_clock(tmp_path, capsys):
    run = tmp_path / "run-1"
    # Rank 1's clock is 50 s ahead; its NaN happened 0.2 s (real time) before rank 0's reduced
    # NaN, although its raw ts is 49.8 s later.
    _write(run, 0, [{"ts": 1000.0, "kind": "start", "clock_offset_seconds": 0.0, "world_size": 2},
                    {"ts": 1010.2, "step": 20, "kind": "nonfinite", "param": "w",
                     "origin": False}])
    _write(run, 1, [{"ts": 1050.0, "kind": "start", "clock_offset_seconds": -50.0,
                     "world_size": 2},
                    {"ts": 1060.0, "step": 20, "kind": "nonfinite", "param": "w",
                     "nonfinite": "nan", "origin": True}])
    code, out = _json(capsys, str(tmp_path))  # the run_dir holding one run works too
    assert code == 0
    assert [(e["rank"], e["kind"]) for e in out["events"] if e["kind"] != "vanished"] == [
        (0, "start"), (1, "start"), (1, "nonfinite"), (0, "nonfinite")]
    ff = out["first_failure"]
    assert (ff["rank"], ff["step"], ff["kind"], ff["param"]) == (1, 20, "nonfinite", "w")
    assert abs(ff["t"] - 1010.0) < 1e-9 and ff["ts"] == 1060.0
    assert out["ranks"]["1"]["clock_offset_seconds"] == -50.0


def test_origin_beats_an_earlier_consequence(tmp_path):
    _write(tmp_path, 0, [{"ts": 1.0, "kind": "start", "world_size": 2},
                         {"ts": 5.0, "step": 3, "kind": "nonfinite", "origin": False},
                         {"ts": 5.1, "step": 3, "kind": "overflow"}])
    _write(tmp_path, 1, [{"ts": 1.0, "kind": "start", "world_size": 2},
                         {"ts": 5.3, "step": 3, "kind": "nonfinite", "origin": True,
                          "param": "enc.w"}])
    ff = build_timeline(tmp_path).first_failure
    assert (ff["rank"], ff["param"], ff["class"]) == (1, "enc.w", "origin")


def test_vanished_rank_named_before_survivors_comm_error(tmp_path):
    _write(tmp_path, 0, [{"ts": 1.0, "kind": "start", "world_size": 2},
                         {"ts": 9.0, "kind": "exit", "reason": "exception",
                          "exc_type": "DistBackendError",
                          "message": "Connection closed by peer [127.0.0.1]:1234"}])
    _write(tmp_path, 1, [{"ts": 1.0, "kind": "start", "world_size": 2},
                         {"ts": 2.0, "step": 4, "kind": "overflow"}])
    progress = tmp_path / "progress.rank1.json"
    progress.write_text('{"step": 7, "ts": 3.0}')  # steps completed after its last event
    tl = build_timeline(tmp_path)
    assert (tl.first_failure["rank"], tl.first_failure["kind"]) == (1, "vanished")
    assert tl.first_failure["step"] == 7 and tl.first_failure["ts"] == 3.0
    assert tl.ranks[1]["ended"].startswith("vanished")
    assert tl.ranks[0]["ended"] == "exception DistBackendError"
    assert tl.ranks[1]["last_event"]["kind"] == "overflow"


def test_stall_culprit_from_flight_recorder(tmp_path):
    # Both ranks stall at once; rank 0 stalls first by clock, but its flight recorder shows it
    # enqueued one collective more: it is waiting for rank 1, which stopped.
    for rank, ts, enq in ((0, 10.0, 12), (1, 10.2, 11)):
        _write(tmp_path, rank, [{"ts": 1.0, "kind": "start", "world_size": 2},
                                {"ts": ts, "step": 30, "kind": "stall", "idle_seconds": 3.0}])
        fr = tmp_path / "flight_recorder"
        fr.mkdir(exist_ok=True)
        (fr / f"fr_trace_rank_{rank}.json").write_text(json.dumps(
            {"pg_status": {"0": {"last_enqueued_collective": str(enq),
                                 "last_completed_collective": str(enq - 1)}}}))
    tl = build_timeline(tmp_path)
    assert (tl.first_failure["rank"], tl.first_failure["kind"]) == (1, "stall")
    assert tl.ranks[0]["flight_recorder"]["last_enqueued_collective"] == 12


def test_crash_file_time_comes_from_mtime(tmp_path):
    _write(tmp_path, 0, [{"ts": 100.0, "kind": "start", "world_size": 2},
                         {"ts": 200.0, "kind": "exit", "reason": "normal", "code": 0}])
    _write(tmp_path, 1, [{"ts": 100.0, "kind": "start", "clock_offset_seconds": 5.0}])
    crash = tmp_path / "crash.rank1.txt"
    crash.write_text('Fatal Python error: Bus error\n\nCurrent thread 0x1 (most recent call '
                     'first):\n  File "/x/train.py", line 7 in step\n')
    os.utime(crash, (150.0, 150.0))
    tl = build_timeline(tmp_path)
    sig = [e for e in tl.events if e["kind"] == "signal"][0]
    assert sig["t"] == 155.0 and sig["signal"] == "SIGBUS"
    assert sig["frame"] == "step (/x/train.py:7)"
    assert tl.first_failure["signal"] == "SIGBUS"


def test_empty_and_missing_and_partial_dirs(tmp_path, capsys):
    code, out = _json(capsys, str(tmp_path / "nope"))
    assert code == 2 and "no such directory" in out["error"]
    code, out = _json(capsys, str(tmp_path))
    assert code == 2 and "no ddpmon run" in out["error"]
    EventLog(tmp_path / "r", 0).close()  # a log file with no events yet
    code, out = _json(capsys, str(tmp_path / "r"))
    assert code == 2 and "no events" in out["error"]
    _write(tmp_path / "p", 0, [{"ts": 1.0, "kind": "start", "world_size": 4}])
    code, out = _json(capsys, str(tmp_path / "p"))
    assert code == 3 and out["partial"] and out["missing_ranks"] == [1, 2, 3]
    capsys.readouterr()
    assert main(["timeline", str(tmp_path / "p")]) == 3
    assert "partial run" in capsys.readouterr().out
    _write(tmp_path / "two" / "a", 0, [{"ts": 1.0, "kind": "start"}])
    _write(tmp_path / "two" / "b", 0, [{"ts": 1.0, "kind": "start"}])
    code, out = _json(capsys, str(tmp_path / "two"))
    assert code == 2 and "several runs" in out["error"]


def test_human_output_names_first_failure(tmp_path, capsys):
    _write(tmp_path, 0, [{"ts": 1.0, "kind": "start", "world_size": 2},
                         {"ts": 3.0, "kind": "signal", "signal": "SIGTERM", "step": 9}])
    _write(tmp_path, 1, [{"ts": 1.0, "kind": "start", "world_size": 2},
                         {"ts": 2.0, "step": 9, "kind": "nonfinite", "param": "head.bias",
                          "origin": True}])
    capsys.readouterr()
    assert main(["timeline", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "First failure: rank 1, step 9, nonfinite (head.bias)" in out
    assert "rank 0: signal SIGTERM" in out


def test_long_parameter_names_are_shown_whole(tmp_path, capsys, monkeypatch):
    """The table folds a name it cannot wrap instead of cutting it ("layers.3.attention.wq.wei…"
    hid the one thing the reader came for); --json has it whole too."""
    name = "model.layers.3.attention.wq.weight_" + "x" * 120
    _write(tmp_path, 0, [{"ts": 1000.0, "kind": "start", "clock_offset_seconds": 0.0,
                          "world_size": 1},
                         {"ts": 1001.0, "step": 4, "kind": "nonfinite", "param": name,
                          "nonfinite": "nan", "origin": True}])
    monkeypatch.setenv("COLUMNS", "80")
    capsys.readouterr()
    assert main(["timeline", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    table = "".join(line.split("│")[-2].strip() for line in out.splitlines() if "│" in line)
    assert name in table, out
    assert _json(capsys, str(tmp_path))[1]["first_failure"]["param"] == name
