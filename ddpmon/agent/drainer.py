"""The agent's record thread: turns queued step values into step records off the training thread.

Per step the training thread only measures and queues (``StepFlow.complete``); reading the
values, deriving the record and running the sinks (metric state, progress file, history, events)
happens here, in batches, every ``interval`` seconds. That keeps the fixed Python cost per
training step small where steps are short (small models, RL, CUDA graphs), and lets the sinks
amortise their I/O over a batch (one progress write per batch, not per step).

Readers never see stale values by surprise: ``Monitor.state``, ``recent_steps()``, a scrape and
``close()`` drain first; a step whose gradients are known non-finite on the host is drained at
once on the training thread, so its evidence holds that step's gradients.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class RecordThread:
    """A daemon thread calling ``drain()`` every ``interval`` seconds until ``stop()``."""

    def __init__(self, drain: Callable[[], None], interval: float = 0.05) -> None:
        self._drain = drain
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpmon-records", daemon=True)

    def start(self) -> RecordThread:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._drain()  # the flow guards its own work: nothing escapes

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
