"""agent.device_wait: on CUDA the step's wait comes from its last collective's timing events,
read on the record thread. No GPU here: the events are stand-ins with CUDA's ``elapsed_time``
contract (milliseconds from one recorded event to another; an error when one is not recorded),
so what is checked is which pair is read and how the parts move, not CUDA itself."""

from __future__ import annotations

import pytest

from ddpmon.agent.device_wait import device_wait, resolve_into, with_device_wait
from ddpmon.metrics.state import StepRecord
from ddpmon.probes.comm import CommTiming


class Event:
    def __init__(self, at: float | None) -> None:
        self.at = at  # seconds on the device's clock; None: never recorded

    def elapsed_time(self, end: Event) -> float:
        if self.at is None or end.at is None:
            raise RuntimeError("event not recorded")
        return (end.at - self.at) * 1000.0


def _timing(*pairs: tuple[float | None, float | None]) -> CommTiming:
    timing = CommTiming()
    for start, end in pairs:
        timing.events.append(("all_reduce", Event(start), Event(end)))
    return timing


def test_the_wait_is_the_last_collectives_span_on_the_device():
    timing = _timing((1.0, 1.5), (2.0, 2.25))
    timing.last_start = timing.events[1][1]
    assert device_wait(timing) == pytest.approx(0.25)
    timing.last_start = timing.events[0][1]  # the one issued last is the one read
    assert device_wait(timing) == pytest.approx(0.5)


def test_no_event_no_pair_or_an_unrecorded_end_changes_nothing():
    assert device_wait(None) is None
    assert device_wait(CommTiming()) is None  # CPU: no event
    timing = _timing((1.0, None))
    timing.last_start = timing.events[0][1]
    assert device_wait(timing) is None
    timing.last_start = Event(0.0)  # its end fell into the next step's timing
    assert device_wait(timing) is None


def test_the_added_wait_comes_out_of_host_then_optimizer_then_backward():
    # data, forward, backward, optimizer, host, wait, communication; the step lasts 0.1 s
    phases = (0.01, 0.02, 0.04, 0.01, 0.02, 0.001, 0.009)
    raised = with_device_wait(phases, 0.031)  # 30 ms more: host's 20, optimizer's 10
    assert raised == pytest.approx((0.01, 0.02, 0.04, 0.0, 0.0, 0.031, 0.009))
    assert sum(raised[1:]) == pytest.approx(sum(phases[1:]))
    deep = with_device_wait(phases, 0.5)  # more than every part holds: all of it, no more
    assert deep == pytest.approx((0.01, 0.0, 0.0, 0.0, 0.0, 0.091, 0.009))
    assert with_device_wait(phases, 0.0005) == phases  # the host saw more: kept
    assert with_device_wait(None, 0.1) is None


def test_the_record_thread_writes_it_into_the_record():
    record = StepRecord(step=1, wall_time=0.0, duration_seconds=0.1, data_wait_seconds=0.01,
                        phase_seconds=(0.01, 0.02, 0.04, 0.01, 0.02, 0.001, 0.009))
    timing = _timing((3.0, 3.011))
    timing.last_start = timing.events[0][1]
    resolve_into(record, timing)
    assert record.phase_seconds == pytest.approx((0.01, 0.02, 0.04, 0.01, 0.01, 0.011, 0.009))
