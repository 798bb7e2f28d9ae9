import json
import threading
import time

from ddpmon.recorder.watchdog import (
    StallWatchdog,
    flight_recorder_path,
    read_flight_recorder_status,
    request_flight_recorder_dump,
)
from tests.support.ports import free_port


def test_fires_once_per_episode_and_rearms():
    beat = [1000.0]
    calls: list[float] = []
    w = StallWatchdog(10.0, lambda: beat[0], calls.append)
    assert not w.check(now=1005.0)  # not stalled yet
    assert w.check(now=1010.5) and calls == [10.5]
    assert not w.check(now=1020.0) and not w.check(now=2000.0)  # same episode: once
    beat[0] = 2100.0  # a step completed: re-armed
    assert not w.check(now=2105.0)
    assert w.check(now=2111.0) and calls == [10.5, 11.0] and w.episodes == 2


def test_thread_reports_real_stall_and_survives_callback_errors():
    last = [time.perf_counter()]
    fired = threading.Event()
    seen: list[float] = []

    def on_stall(idle: float) -> None:
        seen.append(idle)
        fired.set()
        raise RuntimeError("a failing callback must not kill the watchdog")

    w = StallWatchdog(0.3, lambda: last[0], on_stall, poll_seconds=0.05).start()
    try:
        assert fired.wait(5)
        assert seen[0] >= 0.3
        fired.clear()
        last[0] = time.perf_counter()  # progress, then a second stall
        assert fired.wait(5) and len(seen) == 2
    finally:
        w.stop()
    assert w._thread is None


def test_heartbeat_errors_do_not_fire():
    def broken() -> float:
        raise ValueError("no heartbeat")

    w = StallWatchdog(0.01, broken, lambda idle: None)
    assert not w.check(now=time.perf_counter() + 100)


def test_a_wall_clock_step_is_no_stall(monkeypatch):
    """The system time jumping ahead (NTP, a VM's time sync) while steps keep coming is no
    stall: in one goodput run a step that took 0.43 s raised one, idle 1.13 s by the wall clock."""
    beat = [time.perf_counter()]
    calls: list[float] = []
    w = StallWatchdog(1.0, lambda: beat[0], calls.append)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600.0)  # the wall clock stepped 1 h
    assert not w.check()
    beat[0] = time.perf_counter() - 2.0  # the last step ended 2 s ago on the watchdog's clock
    assert w.check() and calls and 2.0 <= calls[0] < 10.0


def test_no_process_group_no_dump(tmp_path):
    assert request_flight_recorder_dump(tmp_path / "fr") is False
    assert not (tmp_path / "fr").exists()


RANK = """
import datetime, json, sys, threading, time
import torch, torch.distributed as dist
rank, port, skew, run = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
if skew:
    _real = time.time
    time.time = lambda: _real() + skew  # this rank's wall clock runs `skew` seconds ahead
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=30))
from ddpmon.recorder.clock import measure_clock_offset
from ddpmon.recorder.watchdog import StallWatchdog, flight_recorder_path, \
    request_flight_recorder_dump
print(json.dumps(measure_clock_offset()), flush=True)
t = torch.ones(4)
dist.all_reduce(t)  # both ranks: collective 1 of the training loop
last = time.perf_counter()  # the watchdog's clock (the skew above moves the wall clock only)
done = threading.Event()
def on_stall(idle):
    ok = request_flight_recorder_dump(flight_recorder_path(run, rank))
    print(json.dumps({"stall": idle, "dumped": ok}), flush=True)
    done.set()
StallWatchdog(1.0, lambda: last, on_stall, poll_seconds=0.1).start()
if rank == 0:
    dist.all_reduce(t)  # blocks: rank 1 never joins
else:
    done.wait(20)  # the "hung" rank issues no further collective
    time.sleep(30)
"""


def test_clock_offset_and_flight_recorder_dump_while_blocked(tmp_path, procs):
    port = free_port()
    run = tmp_path / "run"
    skew = 100.0
    ranks = [
        procs.start(RANK, str(rank), str(port), str(skew if rank else 0.0), str(run))
        for rank in (0, 1)
    ]
    clocks = [json.loads(p.stdout.readline()) for p in ranks]
    stalls = [json.loads(p.stdout.readline()) for p in ranks]
    # Rank 1's clock is 100 s ahead: adding its offset must bring it back to rank 0's clock.
    assert clocks[0]["offset_seconds"] == 0.0
    off, rtt = clocks[1]["offset_seconds"], clocks[1]["rtt_seconds"]
    assert abs(off + skew) <= rtt / 2 + 1e-6 and rtt < 2.0, clocks
    assert clocks[1]["method"] == "all_gather-bounds"
    # Both watchdogs fired and dumped, rank 0 from a thread while its main thread was blocked.
    assert all(s["stall"] >= 1.0 and s["dumped"] for s in stalls), stalls
    status = [read_flight_recorder_status(str(flight_recorder_path(run, r)) + ".json")
              for r in (0, 1)]
    enqueued = [int(s["0"]["last_enqueued_collective"]) for s in status]
    assert enqueued[0] == enqueued[1] + 1, status  # the waiting rank is one collective ahead
    assert flight_recorder_path(run, 0).stat().st_size > 0  # the pickle for fr_trace
