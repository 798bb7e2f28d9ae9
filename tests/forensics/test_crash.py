import json
import os
import signal
import sys
import threading
import time

import pytest

from ddpmon.forensics.timeline import build_timeline
from ddpmon.recorder.crash import CrashCapture, crash_path, sigterm_path
from ddpmon.recorder.eventlog import EventLog, events_path, read_events
from ddpmon.recorder.live_step import LINE_RE, dumps

PRELUDE = """
import os, sys, threading, time
from ddpmon.recorder.crash import CrashCapture
from ddpmon.recorder.eventlog import EventLog
run = sys.argv[1]
log = EventLog(run, 1)
log.emit("start", None, clock_offset_seconds=0.0, world_size=1)
log.emit("step", 24)
CrashCapture(run, 1, log).install()
"""


def _events(run):
    return read_events(events_path(run, 1))[0]


def test_segfault_leaves_crash_file_and_timeline_names_the_signal(tmp_path, procs):
    res = procs.run(PRELUDE + "import ctypes\nctypes.string_at(0)\n", str(tmp_path))
    assert res.returncode == -signal.SIGSEGV
    text = crash_path(tmp_path, 1).read_text()
    assert "Fatal Python error: Segmentation fault" in text and "<string>" in text
    assert [e["kind"] for e in _events(tmp_path)] == ["start", "step"]  # no exit event
    tl = build_timeline(tmp_path)
    ff = tl.first_failure
    assert ff["rank"] == 1 and ff["kind"] == "signal"
    assert (ff["signal"], ff["signum"]) == ("SIGSEGV", 11) and ff["step"] == 24
    assert tl.ranks[1]["ended"] == "signal SIGSEGV"


def test_abort_is_named_too(tmp_path, procs):
    res = procs.run(PRELUDE + "os.abort()\n", str(tmp_path))
    assert res.returncode == -signal.SIGABRT
    assert build_timeline(tmp_path).first_failure["signal"] == "SIGABRT"


def test_uncaught_exception_exit_event_and_torchelastic_error_file(tmp_path, procs):
    err = tmp_path / "error.json"
    code = PRELUDE + "def train():\n    raise ValueError('loss exploded')\ntrain()\n"
    res = procs.run(code, str(tmp_path), env={"TORCHELASTIC_ERROR_FILE": str(err)})
    assert res.returncode == 1 and "ValueError: loss exploded" in res.stderr  # hook chained
    exits = [e for e in _events(tmp_path) if e["kind"] == "exit"]
    assert len(exits) == 1  # not a second one from atexit
    e = exits[0]
    assert e["reason"] == "exception" and e["exc_type"] == "ValueError"
    assert "in train" in e["traceback"] and e["message"] == "loss exploded"
    data = json.loads(err.read_text())  # torchelastic's @record format
    assert data["message"]["message"] == "ValueError: loss exploded"
    assert "in train" in data["message"]["extraInfo"]["py_callstack"]
    assert int(data["message"]["extraInfo"]["timestamp"]) > 0
    ff = build_timeline(tmp_path).first_failure
    assert ff["kind"] == "exit" and ff["exc_type"] == "ValueError"


def test_existing_error_file_is_left_alone(tmp_path, procs):
    err = tmp_path / "error.json"
    err.write_text('{"message": "from @record"}')
    res = procs.run(PRELUDE + "raise KeyError('x')\n", str(tmp_path),
                    env={"TORCHELASTIC_ERROR_FILE": str(err)})
    assert res.returncode == 1 and "KeyError: 'x'" in res.stderr
    exits = [e for e in _events(tmp_path) if e["kind"] == "exit"]
    assert [e["reason"] for e in exits] == ["exception"], "the hook never ran"
    assert err.read_text() == '{"message": "from @record"}'


def test_sys_exit_code_and_normal_exit(tmp_path, procs):
    res = procs.run(PRELUDE + "sys.exit(3)\n", str(tmp_path / "a"))
    assert res.returncode == 3
    exits = [e for e in _events(tmp_path / "a") if e["kind"] == "exit"]
    assert [(e["reason"], e["code"]) for e in exits] == [("normal", 3)]
    assert build_timeline(tmp_path / "a").first_failure["code"] == 3
    res = procs.run(PRELUDE + "pass\n", str(tmp_path / "b"))
    assert res.returncode == 0
    exits = [e for e in _events(tmp_path / "b") if e["kind"] == "exit"]
    assert [(e["reason"], e["code"]) for e in exits] == [("normal", 0)]
    assert build_timeline(tmp_path / "b").first_failure is None


def test_sigterm_dumps_stacks_and_still_terminates(tmp_path, procs):
    code = PRELUDE + (
        "def blocked_in_collective():\n"
        "    print('ready', flush=True)\n"
        "    threading.Event().wait(60)\n"
        "blocked_in_collective()\n"
    )
    proc = procs.start(code, str(tmp_path))
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGTERM  # default disposition kept: it died at once
    assert "blocked_in_collective" in sigterm_path(tmp_path, 1).read_text()
    tl = build_timeline(tmp_path)
    assert tl.ranks[1]["ended"] == "signal SIGTERM"
    assert tl.first_failure["signal"] == "SIGTERM" and tl.first_failure["class"] == "consequence"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_thread_exception_event_and_uninstall_restores(tmp_path):
    log = EventLog(tmp_path, 1)
    before = (sys.excepthook, threading.excepthook, sys.exit)
    cap = CrashCapture(tmp_path, 1, log).install()
    try:
        assert sys.excepthook != before[0] and sys.exit != before[2]

        def boom():
            raise RuntimeError("worker died")

        t = threading.Thread(target=boom, name="loader")
        t.start()
        t.join()
    finally:
        cap.uninstall()
        log.close()
    assert (sys.excepthook, threading.excepthook, sys.exit) == before
    ev = [e for e in _events(tmp_path) if e["kind"] == "thread_exception"]
    assert len(ev) == 1 and ev[0]["thread"] == "loader" and "worker died" in ev[0]["message"]


def test_clean_exit_leaves_no_empty_crash_or_sigterm_file(tmp_path, procs):
    res = procs.run(PRELUDE + "print('ok')\n", str(tmp_path))
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["events.rank1.jsonl"], names  # the event log only
    assert [e["kind"] for e in _events(tmp_path)] == ["start", "step", "exit"]


def test_segfault_keeps_its_crash_file_with_the_stack(tmp_path, procs):
    res = procs.run(PRELUDE + "import ctypes\nctypes.string_at(0)\n", str(tmp_path))
    assert res.returncode == -signal.SIGSEGV
    assert "Segmentation fault" in crash_path(tmp_path, 1).read_text()
    # SIGSEGV ends the process inside the handler: no Python code runs to tidy up, so the
    # SIGTERM file stays, holding only its live line (no dump), and the timeline ignores it.
    assert LINE_RE.fullmatch(sigterm_path(tmp_path, 1).read_text())
    assert dumps(sigterm_path(tmp_path, 1).read_text()) == []
    assert build_timeline(tmp_path).ranks[1]["ended"] == "signal SIGSEGV"


def test_uninstall_removes_empty_files_but_keeps_earlier_stacks(tmp_path):
    log = EventLog(tmp_path, 1)
    cap = CrashCapture(tmp_path, 1, log).install()
    assert crash_path(tmp_path, 1).exists()  # faulthandler needs the fd from the start
    assert LINE_RE.fullmatch(crash_path(tmp_path, 1).read_text())  # the live line, no dump
    cap.live.set(7, ord("O"))
    assert dumps(crash_path(tmp_path, 1).read_text() + "x") == [
        ({"step": 7, "phase": "in the optimizer step", "pid": os.getpid()}, "x", None)]
    cap.uninstall()
    assert not crash_path(tmp_path, 1).exists() and not sigterm_path(tmp_path, 1).exists()
    earlier = "Fatal Python error: Segmentation fault\n"
    crash_path(tmp_path, 1).write_text(earlier)
    os.utime(crash_path(tmp_path, 1), (1000.5, 1000.5))  # when that attempt's dump was written
    cap = CrashCapture(tmp_path, 1, log).install()  # a restarted rank appends to it
    cap.live.set(3, ord("F"))
    # the earlier dump is timed by the line that followed it, not by the file's new mtime
    assert [at for _, _, at in dumps(crash_path(tmp_path, 1).read_text())] == [1000.5]
    cap.uninstall()
    cap.live.set(4, ord("F"))  # after release: a no-op, never a fault
    log.close()
    assert crash_path(tmp_path, 1).read_text() == earlier  # this attempt's line cut off again
    assert crash_path(tmp_path, 1).stat().st_mtime == 1000.5  # and the dump's time kept


def test_the_dump_names_the_step_that_was_running(tmp_path, procs):
    code = PRELUDE.replace("CrashCapture(run, 1, log).install()",
                           "cap = CrashCapture(run, 1, log).install()") + (
        "cap.live.set(25, ord('F'))\nimport ctypes\nctypes.string_at(0)\n")
    assert procs.run(code, str(tmp_path)).returncode == -signal.SIGSEGV
    ff = build_timeline(tmp_path).first_failure
    assert (ff["step"], ff["phase"]) == (25, "in forward or backward")  # not 24, the last done
    assert build_timeline(tmp_path).ranks[1]["last_step"] == 24
