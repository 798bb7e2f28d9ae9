"""Where a rank's step time goes: forward, backward, optimizer, host time outside them, and the
time it waits inside collectives for the other ranks (straggler attribution).

Under DDP every rank's iteration takes as long as the slowest rank's, so step time cannot name a
straggler; what differs is how the time splits. A fast rank finishes its backward early and
then waits for the slow one in the gradient all-reduce; the slow rank waits least. So each rank
measures, on the host clock (``perf_counter``, no device read):

- ``forward``: the model's forward (pre-hook to forward hook), every micro-step summed;
- ``backward``: the forward's end to the end of the backward pass (the loss and the backward
  call, every micro-step summed), less the wait below;
- ``wait``: from the last collective the step issued during the backward
  (``CollectiveRecorder.last_issue``) to the end of that backward: the rank's work is done and
  it waits for the others (plus the transfer of that last bucket, alike on every rank);
- ``optimizer``: the optimizer step (its pre-hook to the step's end);
- ``host``: the rest of the step (first forward to step end): the loop's own code between the
  parts above (clipping, logging, ``zero_grad`` inside the step).

With the step's data wait (the previous step's end to this step's first forward) these are the
step's :data:`PHASES`. A rank's *own* time is everything but ``wait``; comparing it across ranks
names the straggler and the phase that grew its cause (``forensics.stragglers``, and the
``DdpmonStraggler`` rule over the exported totals).

On CUDA the host boundaries are where the host issued the work, not where the device ran it: a
loop that never blocks the host inside the step shows its device time where the host waits
(usually the optimizer's or the loss's read). On CPU (gloo) the host clock is the work's.
"""

from __future__ import annotations

import time
from typing import Any

PHASES = ("data", "forward", "backward", "optimizer", "host", "wait")
"""A step's phases, in the order of :meth:`StepSplit.finish`'s tuple."""
COMPUTE_PHASES = ("forward", "backward", "optimizer")
"""The phases whose growth is cause ``compute``."""


class StepSplit:
    """Per-step phase clock of one rank, fed by the step pipeline's boundaries (training thread:
    a ``perf_counter`` read and a few float additions per boundary)."""

    __slots__ = ("_backward", "_forward", "_forward_end", "_forward_start", "_optimizer_start",
                 "_recorder", "_wait")

    def __init__(self, recorder: Any = None) -> None:
        """``recorder``: the source's ``CollectiveRecorder`` (its ``last_issue``), or None."""
        self._recorder = recorder
        self.reset()

    def reset(self) -> None:
        self._forward = self._backward = self._wait = 0.0
        self._forward_start: float | None = None
        self._forward_end: float | None = None
        self._optimizer_start: float | None = None

    def forward_started(self) -> None:
        self._forward_start = time.perf_counter()

    def forward_ended(self) -> None:
        start = self._forward_start
        if start is not None:
            now = time.perf_counter()
            self._forward += now - start
            self._forward_start = None
            self._forward_end = now

    def backward_ended(self) -> None:
        began = self._forward_end
        if began is None:
            return
        now = time.perf_counter()
        span = now - began
        last = getattr(self._recorder, "last_issue", None)
        wait = now - last if last is not None and last >= began else 0.0
        wait = min(max(wait, 0.0), span)
        self._backward += span - wait
        self._wait += wait
        self._forward_end = None

    def optimizer_started(self) -> None:
        self._optimizer_start = time.perf_counter()

    def finish(self, start: float | None, end: float, data_wait: float | None
               ) -> tuple[float, ...] | None:
        """The step's phase seconds in :data:`PHASES` order (``data`` 0.0 where unknown), then
        ready for the next step; None without a step start."""
        try:
            if start is None:
                return None
            optimizer = end - self._optimizer_start if self._optimizer_start is not None else 0.0
            optimizer = max(optimizer, 0.0)
            inside = self._forward + self._backward + self._wait + optimizer
            host = max(end - start - inside, 0.0)
            return (data_wait or 0.0, self._forward, self._backward, optimizer, host, self._wait)
        finally:
            self.reset()
