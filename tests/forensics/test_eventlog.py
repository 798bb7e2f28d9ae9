import json
import math
import threading

import torch

from ddpmon.recorder.eventlog import (
    EventLog,
    ProgressFile,
    events_path,
    progress_path,
    read_events,
    read_progress,
)


def test_emit_appends_strict_json_lines_flushed(tmp_path):
    log = EventLog(tmp_path, 3)
    log.emit("start", None, clock_offset_seconds=0.25, world_size=2)
    # Visible to another reader before close: nothing is buffered in the process.
    lines = events_path(tmp_path, 3).read_text().splitlines()
    assert len(lines) == 1
    log.emit("nonfinite", 7, param="w", value=float("nan"), big=float("inf"),
             t=torch.tensor(2.5), path=tmp_path, obj=object())
    log.close()
    events = [json.loads(line) for line in events_path(tmp_path, 3).read_text().splitlines()]
    assert [e["kind"] for e in events] == ["start", "nonfinite"]
    first, second = events
    assert first["rank"] == 3 and first["step"] is None and first["clock_offset_seconds"] == 0.25
    assert second["step"] == 7 and second["value"] == "nan" and second["big"] == "inf"
    assert second["t"] == 2.5 and second["path"] == str(tmp_path)
    assert second["obj"].startswith("<object object")
    assert abs(second["ts"] - first["ts"]) < 60 and math.isfinite(second["ts"])


def test_append_only_across_reopen(tmp_path):
    a = EventLog(tmp_path, 0)
    a.emit("start")
    a.close()
    b = EventLog(tmp_path, 0)  # a restarted rank keeps the earlier lines
    b.emit("exit", 5, code=0)
    b.close()
    events, bad = read_events(events_path(tmp_path, 0))
    assert [e["kind"] for e in events] == ["start", "exit"] and bad == 0


def test_concurrent_writers_never_interleave(tmp_path):
    log = EventLog(tmp_path, 1)
    payload = "x" * 3000  # lines longer than a pipe buffer's atomic size still stay whole

    def worker(n: int) -> None:
        for i in range(200):
            log.emit("step", i, thread=n, payload=payload)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    events, bad = read_events(events_path(tmp_path, 1))
    assert bad == 0 and len(events) == 800
    for n in range(4):
        assert [e["step"] for e in events if e["thread"] == n] == list(range(200))


def test_reader_skips_torn_last_line(tmp_path):
    log = EventLog(tmp_path, 0)
    log.emit("start")
    log.close()
    with open(events_path(tmp_path, 0), "a") as fh:
        fh.write('{"ts": 1, "kind": "sta')  # a write cut short by power loss
    events, bad = read_events(events_path(tmp_path, 0))
    assert len(events) == 1 and bad == 1


def test_emit_never_raises(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    log = EventLog(blocker, 0)  # cannot create the directory
    log.emit("start")  # must not raise
    log.close()
    closed = EventLog(tmp_path, 0)
    closed.close()
    closed.emit("late")  # after close: dropped silently
    assert read_events(events_path(tmp_path, 0))[0] == []


def test_progress_file_survives_sigkill(tmp_path, procs):
    code = """
    import os, signal, sys
    from ddpmon.recorder.eventlog import ProgressFile
    p = ProgressFile(sys.argv[1], 1)
    for step in range(1000):
        p.update(step, ts=1000.0 + step)
    os.kill(os.getpid(), signal.SIGKILL)
    """
    res = procs.run(code, str(tmp_path))
    assert res.returncode == -9
    assert read_progress(progress_path(tmp_path, 1)) == {"step": 999, "ts": 1999.0}
    assert len(progress_path(tmp_path, 1).read_bytes()) == ProgressFile.SIZE
