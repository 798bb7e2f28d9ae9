"""A process is known by its PID and its start time (PIDs are reused). psutil gives the start
time on the wall clock, adding the boot time that Linux reports in whole seconds of the wall
clock less the uptime (``/proc/stat``'s btime), read anew at each call: a step of the wall clock
moves it by a second. The daemon's start times must not move with it, or every live rank of a
node is named dead at once and leaves discovery (seen once in the two-node test).

Stepping this machine's clock would disturb every other test, so the step is the boot time that
psutil reads, shifted by a second: the sanity check shows psutil's own figure moving."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from ddpmon.daemon import processes

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="psutil's Linux boot time")


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _step_the_wall_clock(monkeypatch, seconds: float) -> None:
    real = psutil._pslinux.boot_time
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: real() - seconds)


def test_a_wall_clock_step_leaves_a_live_process_alive(child, monkeypatch):
    started = processes.process_start_time(child.pid)
    before = psutil.Process(child.pid).create_time()
    assert processes.same_process(child.pid, started)
    _step_the_wall_clock(monkeypatch, 1.0)
    assert psutil.Process(child.pid).create_time() == pytest.approx(before - 1.0), "no step"
    assert processes.same_process(child.pid, started)
    assert processes.process_start_time(child.pid) == pytest.approx(started, abs=1e-6)
    assert processes.descends_from(child.pid, os.getpid(), processes.process_start_time(
        os.getpid()))


def test_another_start_time_is_still_another_process(child, monkeypatch):
    started = processes.process_start_time(child.pid)
    _step_the_wall_clock(monkeypatch, 1.0)
    assert not processes.same_process(child.pid, started - 1.0)
    assert not processes.same_process(child.pid, started + 0.5)
