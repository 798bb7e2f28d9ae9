"""Host time a rank spends handing its own collectives to the backend: the ``communication``
part of its step (``agent.step_split``).

A fast rank waits for a slow one inside the collective; that wait is the same whether the slow
rank computed longer or reached the network later. What tells them apart is where the slow
rank's time went: a rank whose own path to the network is slow (a comm hook that compresses or
stalls, a congested or throttled issue path, a sleep injected in a test) spends it *issuing* its
collectives, the call that hands the work to the backend, which for an asynchronous collective
otherwise returns at once. So the strategies time that call (DDP's comm hook around the inner
hook, ``CollectiveRecorder.call`` around a call that returns a ``Work``): a clock read and a
read of the thread's scheduler counters each side, no device read. A collective issued
synchronously (it returns when done) is not counted: its call holds the wait for the other
ranks too.

Stalled, not descheduled. Inside the call the thread is running, runnable (waiting for a CPU
another thread holds: the backend's own threads wake up right then, and on a shared host other
processes' threads) or blocked. Only *blocked* time is the path's stall; waiting for a CPU is the
host's load, which would otherwise add noise to every rank's own time. Linux's per-thread
``schedstat`` (``/proc/self/task/<tid>/schedstat``: time on the CPU and time waiting for one,
read with one ``pread`` on a descriptor kept per thread) gives both; where it is missing the
thread's CPU clock stands in, and waiting for a CPU then counts as blocked.

What this cannot see: a link that slows a ring alike for every rank (each rank's collective
takes longer, none issues later) is no rank's own time; the run's collective times show it
(``DdpmonCollectiveSlow``).
"""

from __future__ import annotations

import os
import threading
import time

_NS = 1e-9


class _Schedstat(threading.local):
    """This thread's ``schedstat`` descriptor (opened on first use; -1: not available)."""

    fd: int | None = None


_local = _Schedstat()


def runnable_seconds() -> float:
    """Seconds this thread has been running or waiting for a CPU (schedstat's first two
    fields), else its CPU time."""
    fd = _local.fd
    if fd is None:
        try:
            fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
        except OSError:
            fd = -1
        _local.fd = fd
    if fd >= 0:
        try:
            running, waiting, _ = os.pread(fd, 96, 0).split(maxsplit=2)
            return (int(running) + int(waiting)) * _NS
        except (OSError, ValueError):
            _local.fd = -1
    return time.thread_time()


class IssueClock:
    """Seconds spent inside collective issue calls since the last :meth:`take`: on the wall
    clock, and running or runnable on the issuing thread (a float addition per call; hooks may
    run on the autograd thread, each begin/end pair on one thread)."""

    __slots__ = ("runnable", "wall")

    def __init__(self) -> None:
        self.wall = self.runnable = 0.0

    @staticmethod
    def begin() -> tuple[float, float]:
        return time.perf_counter(), runnable_seconds()

    def end(self, began: tuple[float, float]) -> None:
        wall, runnable = began
        self.runnable += runnable_seconds() - runnable
        self.wall += time.perf_counter() - wall

    def take(self) -> tuple[float, float]:
        """``(wall, runnable)`` seconds since the last take (runnable at most wall), then
        zero: ``wall - runnable`` is the time the calls were blocked."""
        out = (self.wall, min(max(self.runnable, 0.0), self.wall))
        self.wall = self.runnable = 0.0
        return out
