"""Host time a rank spends handing its own collectives to the backend: the ``communication``
part of its step (``agent.step_split``).

A fast rank waits for a slow one inside the collective; that wait is the same whether the slow
rank computed longer or reached the network later. What tells them apart is where the slow
rank's time went: a rank whose own path to the network is slow (a comm hook that compresses or
stalls, a congested or throttled issue path, a sleep injected in a test) spends it *issuing* its
collectives, the call that hands the work to the backend, which for an asynchronous collective
otherwise returns at once. So the strategies time that call (DDP's comm hook around the inner
hook, ``CollectiveRecorder.call`` around a call that returns a ``Work``): two clock reads each,
no device read. A collective issued synchronously (it returns when done) is not counted: its
call holds the wait for the other ranks too.

What this cannot see: a link that slows a ring alike for every rank (each rank's collective
takes longer, none issues later) is no rank's own time; the run's collective times show it
(``DdpmonCollectiveSlow``).
"""

from __future__ import annotations

import time


class IssueClock:
    """Seconds spent inside collective issue calls since the last :meth:`take`, on the wall
    clock and on the issuing thread's CPU clock (a float addition per call; hooks may run on
    the autograd thread, each begin/end pair on one thread)."""

    __slots__ = ("cpu", "wall")

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    @staticmethod
    def begin() -> tuple[float, float]:
        return time.perf_counter(), time.thread_time()

    def end(self, began: tuple[float, float]) -> None:
        wall, cpu = began
        self.wall += time.perf_counter() - wall
        self.cpu += time.thread_time() - cpu

    def take(self) -> tuple[float, float]:
        """``(wall, cpu)`` seconds since the last take (cpu at most wall), then zero."""
        out = (self.wall, min(self.cpu, self.wall))
        self.wall = self.cpu = 0.0
        return out
