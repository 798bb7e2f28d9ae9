"""A rank's activity (agent.activity), the innermost user frame (agent.user_frame), mon.phase
(step_phase.marked) and the holder rule (hang_naming), on fixed clocks and recorder dumps."""

from __future__ import annotations

import threading
import time

import pytest

from ddpmon import metrics as m
from ddpmon.agent.activity import Activity, op_name, read_collectives
from ddpmon.agent.step_phase import MAX_LOOP_PHASES, StepPhase
from ddpmon.agent.user_frame import innermost_user_frame
from ddpmon.daemon.hang_naming import RankActivity, name_hang, parse_activity
from ddpmon.recorder.live_step import CHECKPOINT, DATA, FORWARD, NO_LIVE


def entry(seq, state="scheduled", group="0", op="gloo:all_reduce", at=100.0):
    return {"collective_seq_id": seq, "process_group": [group, "pg"], "profiling_name": op,
            "state": state, "time_created_ns": int(at * 1e9)}


def dump(seqs, *entries):
    return {"pg_status": {g: {"last_enqueued_collective": str(s)} for g, s in seqs.items()},
            "entries": list(entries)}


def test_read_collectives_keeps_the_oldest_uncompleted_per_group():
    seen = read_collectives(dump(
        {"0": 37, "1": 4},
        entry(35, "completed", at=90.0), entry(36, at=95.0), entry(37, at=96.0),
        entry(4, "completed", group="1", op="gloo:barrier", at=97.0),
    ))
    assert seen.sequences == {"0": 37, "1": 4}
    (inflight,) = seen.inflight
    assert (inflight.group, inflight.op, inflight.seq, inflight.since) == ("0", "all_reduce",
                                                                           36, 95.0)
    assert seen.last_issued == 97.0


@pytest.mark.parametrize("bad", [None, [], {"pg_status": "x", "entries": {}},
                                 {"pg_status": {"0": {}}, "entries": [{"state": 3}, "x"]}])
def test_read_collectives_tolerates_damaged_dumps(bad):
    seen = read_collectives(bad)
    assert seen.inflight == () and seen.last_issued == 0.0


def test_op_names_are_bounded():
    assert op_name("nccl:allreduce") == "all_reduce"
    assert op_name("gloo:barrier") == "barrier"
    assert op_name("gloo:\x1b[31mrm -rf") == "other"


class Pipeline(StepPhase):
    def __init__(self):
        self.step, self.phase, self.live = 3, DATA, NO_LIVE


def activity(pipeline, recorder, now, steps=5, last_step=0.0, thread=-1):
    return Activity(pipeline, lambda: steps, lambda: last_step, 30.0, thread,
                    read_recorder=lambda: recorder, clock=lambda: now[0])


def test_a_progressing_rank_exports_its_phase_and_reads_no_recorder():
    pipeline = Pipeline()
    pipeline._at(FORWARD)
    calls = []
    act = Activity(pipeline, lambda: 5, lambda: 0.0, 30.0, -1,
                   read_recorder=lambda: calls.append(1) or {}, clock=time.time)
    samples = act.samples()
    assert samples[m.PHASE_SINCE] == [(("forward_backward",), pipeline.phase_since)]
    assert m.STUCK not in samples and calls == []


def test_a_rank_without_progress_for_hang_seconds_is_stuck_in_its_frame():
    pipeline = Pipeline()
    pipeline.phase_since = 1000.0
    now = [1010.0]
    act = activity(pipeline, dump({"0": 36}, entry(36, at=1001.0)), now,
                   thread=threading.get_ident())
    assert m.STUCK not in act.samples()  # 9 s since the all-reduce was issued
    now[0] = 1031.5
    samples = act.samples()
    ((labels, seconds),) = samples[m.STUCK]
    assert labels[0] == "data" and labels[2] == "0" and seconds == pytest.approx(30.5)
    assert labels[1].startswith("test_activity.py:") and "in samples" not in labels[1]
    assert samples[m.COLLECTIVE_INFLIGHT_SEQUENCE] == [(("0", "all_reduce"), 36.0)]


def test_a_checkpoint_a_marked_phase_and_the_first_step_are_quiet():
    pipeline = Pipeline()
    pipeline._at(CHECKPOINT)
    pipeline.phase_since = 1000.0
    now = [1100.0]
    assert activity(pipeline, {}, now).samples()[m.STUCK][0][0][2] == "1"
    pipeline._at(DATA)
    with pipeline.marked("eval"):
        pipeline.phase_since = 1000.0
        labels = activity(pipeline, {}, now).samples()[m.STUCK][0][0]
        assert labels[0] == "eval" and labels[2] == "1"
        with pipeline.marked("reshard", quiet=False):
            pipeline.phase_since = 1000.0
            labels = activity(pipeline, {}, now).samples()[m.STUCK][0][0]
            assert labels[0] == "reshard" and labels[2] == "0"
    pipeline.phase_since = 1000.0
    assert activity(pipeline, {}, now, steps=0).samples()[m.STUCK][0][0][2] == "1"
    assert pipeline.loop_phase.current is None


def test_mon_phase_names_are_checked_and_bounded():
    pipeline = Pipeline()
    with pytest.raises(ValueError, match="mon.phase"), pipeline.marked("Eval pass"):
        pass
    for i in range(MAX_LOOP_PHASES + 3):
        with pipeline.marked(f"p{i}"):
            name = pipeline.loop_phase.current[0]
    assert name == "other" and len(pipeline.loop_phase.names) == MAX_LOOP_PHASES


def test_a_recorder_that_fails_is_counted_once_and_the_phase_still_exported():
    errors = []
    pipeline = Pipeline()
    pipeline.phase_since = 1000.0

    def broken():
        raise RuntimeError("no recorder")

    act = Activity(pipeline, lambda: 5, lambda: 0.0, 30.0, -1, read_recorder=broken,
                   clock=lambda: 1100.0, on_error=lambda probe, exc: errors.append(probe))
    for _ in range(3):
        samples = act.samples()
    assert errors == ["activity"] and m.STUCK in samples and m.COLLECTIVE_SEQUENCE not in samples


def test_innermost_user_frame_skips_library_frames():
    started, stop = threading.Event(), threading.Event()

    def user_wait():
        started.set()
        stop.wait(10)  # threading.Event.wait: a standard-library frame is innermost

    thread = threading.Thread(target=user_wait)
    thread.start()
    started.wait(5)
    try:
        frame = innermost_user_frame(thread.ident)
        assert frame.startswith("test_activity.py:") and frame.endswith("in user_wait")
    finally:
        stop.set()
        thread.join()
    assert innermost_user_frame(-1) is None


def rank(r, seqs, inflight=None, stuck=True, phase="forward_backward", quiet=False):
    return RankActivity(rank=r, phase=phase, sequences=seqs, inflight=inflight or {},
                        stuck_seconds=40.0 if stuck else None, frame=f"f{r}", quiet=quiet)


def test_name_hang_names_the_rank_behind_on_the_busiest_group():
    wait = {"0": {"op": "all_reduce", "seq": 36, "since": 5.0}}
    ranks = [rank(0, {"0": 36, "1": 4}, wait), rank(1, {"0": 36, "1": 4}, wait),
             rank(2, {"0": 36, "1": 4}, wait),
             rank(3, {"0": 35, "1": 5}, {"1": {"op": "barrier", "seq": 5}}, phase="data")]
    hang = name_hang(ranks)
    assert hang["collective"] == {"op": "all_reduce", "group": "0", "seq": 36, "since": 5.0}
    assert hang["waiting"] == [0, 1, 2] and hang["pages"]
    assert [(h["rank"], h["phase"], h["frame"], h["seq"]) for h in hang["holders"]] == [
        (3, "data", "f3", 35)]


def test_name_hang_is_quiet_for_a_quiet_holder_and_silent_without_waiters():
    wait = {"0": {"op": "all_reduce", "seq": 9}}
    hang = name_hang([rank(0, {"0": 9}, wait), rank(1, {"0": 8}, phase="eval", quiet=True)])
    assert hang["holders"][0]["phase"] == "eval" and not hang["pages"]
    assert name_hang([rank(0, {"0": 9}), rank(1, {"0": 8})]) is None
    early = name_hang([rank(0, {"0": 9}, wait, stuck=False), rank(1, {"0": 8}, stuck=False)])
    assert [h["rank"] for h in early["holders"]] == [1] and not early["pages"]


def test_parse_activity_reads_the_exposition_back_cleaned():
    from tests.unit.test_collector import make_exposition

    act = parse_activity(make_exposition(activity=True).render().decode())
    assert act.rank == 1 and act.phase == "data" and act.sequences == {"0": 36}
    assert act.inflight == {"0": {"op": "all_reduce", "seq": 36, "since": 1020.0}}
    assert act.stuck_seconds == 80.0 and act.frame == "unknown" and not act.quiet
    hostile = ('ddpmon_stuck_seconds{run="r",rank="2",phase="x",frame="a\x1b[2Jb",'
               'quiet="0"} 5\n')
    assert "\x1b" not in (parse_activity(hostile).frame or "")


def test_the_pipeline_keeps_phase_and_since_in_host_stores():
    pipeline = Pipeline()
    before = time.time()
    pipeline._at(FORWARD)
    assert pipeline.phase == FORWARD and pipeline.phase_since >= before
    since = pipeline.phase_since
    pipeline._at(FORWARD)  # the same phase again: not a change
    assert pipeline.phase_since == since


def test_the_daemons_job_summary_names_the_hang_among_its_ranks():
    """The node daemon's job record (daemon.summary.merge) over real HTTP: two ranks, one
    waiting in all-reduce #9, one that last issued #8 and is stuck in its data loader."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from ddpmon.daemon import summary

    pages = {
        0: 'ddpmon_collective_sequence{run="r",rank="0",group="0"} 9\n'
           'ddpmon_collective_inflight_sequence{run="r",rank="0",group="0",op="all_reduce"} 9\n'
           'ddpmon_stuck_seconds{run="r",rank="0",phase="forward_backward",frame="t.py:3 in '
           'main",quiet="0"} 40\n',
        1: 'ddpmon_collective_sequence{run="r",rank="1",group="0"} 8\n'
           'ddpmon_stuck_seconds{run="r",rank="1",phase="data",frame="d.py:7 in load",'
           'quiet="0"} 41\n',
    }
    class Page(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            body = self.server.body
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    servers = []
    for r in (0, 1):
        server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
        server.body = pages[r].encode()
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    try:
        merged = summary.merge({}, "127.0.0.1", [s.server_address[1] for s in servers])
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
    assert merged["ranks"]["1"]["activity"]["frame"] == "d.py:7 in load"
    hang = merged["hang"]
    assert hang["waiting"] == [0] and hang["collective"]["seq"] == 9 and hang["pages"]
    assert [(h["rank"], h["phase"], h["frame"]) for h in hang["holders"]] == [
        (1, "data", "d.py:7 in load")]


def test_name_hang_names_the_rank_in_another_op_at_the_same_sequence_number():
    from ddpmon.commands.top import _hang_line

    reduce = {"0": {"op": "all_reduce", "seq": 36, "since": 5.0}}
    ranks = [rank(r, {"0": 36}, reduce, phase="data") for r in range(3)]
    odd = rank(3, {"0": 36}, {"0": {"op": "broadcast", "seq": 36}}, phase="data")
    hang = name_hang([*ranks, odd])
    assert hang["holders"] == [] and hang["waiting"] == [0, 1, 2, 3] and hang["pages"]
    assert hang["collective"]["op"] == "all_reduce"
    assert [(h["rank"], h["op"], h["phase"], h["frame"]) for h in hang["mismatch"]] == [
        (3, "broadcast", "data", "f3")]
    assert _hang_line(hang).endswith("for: rank 3 in broadcast instead (data, at f3)")
    # A tie has no majority to name against; a quiet odd rank does not page.
    tie = name_hang([*ranks[:2], odd, rank(2, {"0": 36}, {"0": {"op": "broadcast", "seq": 36}})])
    assert tie["mismatch"] == [] and not tie["pages"]
    quiet = rank(3, {"0": 36}, {"0": {"op": "broadcast", "seq": 36}}, phase="eval", quiet=True)
    calm = name_hang([*ranks, quiet])
    assert [h["rank"] for h in calm["mismatch"]] == [3] and not calm["pages"]
    # Behind ranks are holders; then no mismatch is looked for.
    assert name_hang([*ranks, rank(3, {"0": 35}, phase="data")])["mismatch"] == []


def test_top_shows_what_each_rank_does_and_the_hang_line():
    from ddpmon.commands.top import _hang_line, _now

    wait = {"0": {"op": "all_reduce", "seq": 36, "since": 5.0}}
    waiting = rank(0, {"0": 36}, wait)
    holder = rank(3, {"0": 35}, phase="data")
    assert _now(waiting) == "forward_backward all_reduce#36@0 stuck 40s at f0"
    assert _now(rank(1, {"0": 3}, stuck=False)) == "forward_backward"
    line = _hang_line(name_hang([waiting, holder]))
    assert line == "hang: ranks [0] wait in all_reduce #36 on group 0 for: rank 3 (data, at f3)"
    quiet = name_hang([waiting, rank(3, {"0": 35}, phase="eval", quiet=True)])
    assert _hang_line(quiet).endswith("for: rank 3 (eval, quiet, at f3) (no page)")


@pytest.mark.parametrize("hung, kept", [("9", range(16)), ("19", [*range(15), 19])])
def test_past_16_groups_the_hung_one_is_kept_and_the_rest_fill_by_number(hung, kept):
    seqs = {str(g): 10 for g in range(20)}  # by string order "9" would be cut ("10" < "9")
    seen = read_collectives(dump(seqs, entry(10, group=hung, at=50.0)))
    assert [f.group for f in seen.inflight] == [hung]
    assert list(seen.sequences) == sorted(map(str, kept), key=int)


class PoppedBetween(list):
    """A phase stack the training thread pops between a check and an index (the race)."""

    def __bool__(self):
        nonempty = len(self) > 0
        self.clear()
        return nonempty


def test_a_scrape_reads_the_marked_phase_without_racing_its_exit():
    pipe = StepPhase()
    with pipe.marked("eval"):
        pipe.loop_phase.stack = PoppedBetween(pipe.loop_phase.stack)
        assert pipe.loop_phase.current == ("eval", True)  # read once: no IndexError


def test_a_stall_whose_activity_fails_is_still_an_event_and_counted(tmp_path):
    import json

    import torch
    from torch import nn

    import ddpmon
    from ddpmon.rundir.layout import RunDir

    model = nn.Linear(2, 1)
    mon = ddpmon.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), port=0,
                        bind="127.0.0.1", run_dir=str(tmp_path), run_id="stall")
    try:
        def broken():
            raise RuntimeError("activity read failed")

        mon.activity.stall_fields = broken
        mon._on_stall(7.0)
    finally:
        mon.close()
    lines = RunDir(mon.run_path).events(0).read_text().splitlines()
    (stall,) = [e for e in map(json.loads, lines) if e["kind"] == "stall"]
    assert stall["idle_seconds"] == 7.0
    assert mon.state.agent_errors["activity"] == 1
