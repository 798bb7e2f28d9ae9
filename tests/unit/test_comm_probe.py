"""The collective recorder (ddpmon.probes.comm): sync and async timing, bounds, bad op names."""

import threading
import time

import pytest
import torch
import torch.distributed as dist

from ddpmon.metrics.state import MetricState, StepRecord
from ddpmon.probes.comm import OPS, CollectiveRecorder, tensor_bytes
from tests.support.ports import free_ports


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group: real Work objects and futures, no peer needed."""
    if dist.is_initialized():
        yield None
        return
    port = free_ports(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield None
    dist.destroy_process_group()


def test_sync_call_is_timed_to_its_return_with_its_bytes():
    rec = CollectiveRecorder()
    out = rec.call("all_reduce", 400, lambda: time.sleep(0.02) or "result")
    assert out == "result"
    t = rec.take()
    assert t.bytes == {"all_reduce": 400}
    (op, seconds), = t.seconds
    assert op == "all_reduce" and 0.02 <= seconds < 1.0
    assert rec.take() is None  # taken once


def test_async_work_is_timed_at_completion_without_waiting(group):
    rec = CollectiveRecorder()
    x = torch.ones(1000)
    work = rec.call("all_reduce", tensor_bytes(x), dist.all_reduce, x, async_op=True)
    work.wait()  # the caller's own wait; the recorder never waits
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the future's callback may run on gloo's thread
        timing = rec.take()
        if timing is not None:
            break
        time.sleep(0.01)
    assert timing is not None and timing.bytes == {"all_reduce": 4000}
    assert timing.resolve()["all_reduce"][0] >= 0


def test_the_callees_keywords_pass_through_even_op_and_nbytes():
    rec = CollectiveRecorder()
    assert rec.call("reduce_scatter", 1, lambda **kw: kw, op="SUM", nbytes=3, fn=None) == {
        "op": "SUM", "nbytes": 3, "fn": None}


def test_errors_in_the_recorder_never_reach_the_caller_but_the_callees_do():
    errors = []
    rec = CollectiveRecorder(lambda probe, exc: errors.append((probe, exc)))
    rec.call("no_such_op", 1, lambda: None)  # a strategy bug: counted, not raised
    assert errors and errors[0][0] == "comm" and "no_such_op" in str(errors[0][1])

    def boom():
        raise RuntimeError("the collective itself failed")

    with pytest.raises(RuntimeError, match="itself failed"):
        rec.call("all_gather", 1, boom)


def test_a_step_keeps_a_bounded_number_of_timings_but_every_byte():
    rec = CollectiveRecorder()
    for _ in range(5000):
        rec.record("send", 0.001, 2)
    t = rec.take()
    assert t.count == 4096 and t.dropped == 5000 - 4096 and t.bytes == {"send": 10000}


def test_threads_record_concurrently():
    rec = CollectiveRecorder()

    def worker():
        for _ in range(200):
            rec.record("recv", 0.001, 1)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    t = rec.take()
    assert t.count == 800 and t.bytes["recv"] == 800


def test_state_exports_only_ops_seen_in_exposition_order():
    s = MetricState()
    s.apply(StepRecord(step=0, wall_time=0.0, duration_seconds=None, data_wait_seconds=None,
                       collective_seconds={"recv": [0.01], "all_gather": [0.001, 0.002]},
                       collective_bytes={"recv": 8, "all_gather": 16}))
    assert set(s.collective_duration) == {"recv", "all_gather"}
    assert s.collective_duration["all_gather"].count == 2 and s.collective_count() == 3
    assert s.collective_bytes_total == {"recv": 8, "all_gather": 16}
    assert OPS.index("all_gather") < OPS.index("recv")


def test_top_shows_the_mean_per_op_from_a_real_exposition():
    from ddpmon.commands.top import _per_op_ms
    from ddpmon.export.scrape import flatten
    from tests.unit.test_collector import make_exposition

    s = MetricState()
    s.apply(StepRecord(step=0, wall_time=0.0, duration_seconds=None, data_wait_seconds=None,
                       collective_seconds={"reduce_scatter": [0.002, 0.004], "recv": [0.01]},
                       collective_bytes={"reduce_scatter": 100, "recv": 8}))
    flat = flatten(make_exposition(s).render().decode())
    assert flat['ddpmon_collective_duration_seconds_count{op="reduce_scatter"}'] == 2
    assert flat["ddpmon_collective_duration_seconds_count"] == 3  # summed over ops
    assert flat["ddpmon_collective_bytes_total"] == 108
    assert _per_op_ms(flat) == "rs 3.0 recv 10.0 ms"
    assert _per_op_ms({}) == "-"
