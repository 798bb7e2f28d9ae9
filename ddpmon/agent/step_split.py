"""Where a rank's step time goes: forward, backward, optimizer, host time outside them, and the
time it waits inside collectives for the other ranks (straggler attribution).

Under DDP every rank's iteration takes as long as the slowest rank's, so step time cannot name a
straggler; what differs is how the time splits. A fast rank finishes its backward early and
then waits for the slow one in the gradient all-reduce; the slow rank waits least. So each rank
measures, without a device read:

- ``forward``: the model's forward (pre-hook to forward hook), every micro-step summed;
- ``backward``: the forward's end to the end of the backward pass (the loss and the backward
  call, every micro-step summed), less the wait below; where one call marked by the strategy
  runs every micro-batch's forward and backward (a schedule's ``step``), its time is
  ``backward`` (``forward`` 0), and a stage's bubble, waiting for its neighbours, is ``wait``;
- ``wait``: from the last collective the step issued during the backward
  (``CollectiveRecorder.last_issue``) to the end of that backward: the rank's work is done and
  it waits for the others (plus the transfer of that last bucket, alike on every rank); on CPU,
  see Clocks below;
- ``optimizer``: the optimizer step (its pre-hook to the step's end);
- ``host``: the rest of the step (first forward to step end): the loop's own code between the
  parts above (clipping, logging, ``zero_grad`` inside the step);
- ``communication``: the time the rank spent issuing its own collectives
  (``probes.comm_issue``: a slow path to the network, which the others wait for). On CPU, the
  time the issue calls were blocked (neither running nor waiting for a CPU; taken out of
  ``wait``; their CPU time stays in the part that ran them); elsewhere their wall time, taken
  out of ``backward``.

With the step's data wait (the previous step's end to this step's first forward) these are the
step's :data:`PHASES`. A rank's *own* time is everything but ``wait``; comparing it across ranks
names the straggler and the phase that grew its cause (``forensics.stragglers``, and the
``DdpmonStraggler`` rule over the exported totals).

Clocks. On CPU (every parameter on the CPU) the work is the training thread's: forward,
backward, optimizer and host are its CPU time (``time.thread_time``), and ``wait`` is the rest of
the step's wall time, where the thread ran nothing: blocked in a collective for the other ranks,
or not scheduled at all (a host shared with other processes slows every rank's wall time, not
its work, and is not a straggler of the run). Elsewhere the parts are wall time
(``perf_counter``) and ``wait`` is measured from the backward's last collective as above; the
host boundaries are where the host issued the work, not where the device ran it, so a loop that
never blocks the host inside the step shows its device time where the host waits. With NCCL,
DDP's ``work.wait()`` does not block the host, so this ``wait`` is near 0 on every rank; the
record thread raises it to the wait measured on the device (``agent.device_wait``). The clock is
chosen once, at construction (attach), from the parameters' devices then.
"""

from __future__ import annotations

import time
from typing import Any

PHASES = ("data", "forward", "backward", "optimizer", "host", "wait", "communication")
"""A step's phases, in the order of :meth:`StepSplit.finish`'s tuple."""
COMPUTE_PHASES = ("forward", "backward", "optimizer")
"""The phases whose growth is cause ``compute``."""


class StepSplit:
    """Per-step phase clock of one rank, fed by the step flow's boundaries (training thread:
    one clock read and a few float additions per boundary)."""

    __slots__ = ("_backward", "_clock", "_forward", "_forward_end", "_forward_start", "_on_cpu",
                 "_optimizer_start", "_recorder", "_step_start", "_wait")

    def __init__(self, recorder: Any = None, params: Any = ()) -> None:
        """``recorder``: the source's ``CollectiveRecorder`` (its ``last_issue``), or None;
        ``params``: the model's parameters (all on CPU: the CPU clock is used)."""
        self._recorder = recorder
        self._on_cpu = on_cpu(params)
        self._clock = time.thread_time if self._on_cpu else time.perf_counter
        self.reset()

    def reset(self) -> None:
        issue = getattr(self._recorder, "issue", None)
        if issue is not None:  # a step's issue time starts with the step
            issue.take()
        self._forward = self._backward = self._wait = 0.0
        self._step_start: float | None = None
        self._forward_start: float | None = None
        self._forward_end: float | None = None
        self._optimizer_start: float | None = None

    def forward_started(self) -> None:
        self._forward_start = now = self._clock()
        if self._step_start is None:
            self._step_start = now

    def forward_ended(self) -> None:
        start = self._forward_start
        if start is not None:
            now = self._clock()
            self._forward += now - start
            self._forward_start = None
            self._forward_end = now

    def backward_ended(self) -> None:
        began = self._forward_end
        if began is None:  # one call ran forward and backward: a schedule's step
            began, self._forward_start = self._forward_start, None
            if began is None:
                return
        now = self._clock()
        span = now - began
        wait = 0.0
        if not self._on_cpu:  # the CPU clock does not run while the thread waits
            last = getattr(self._recorder, "last_issue", None)
            wait = now - last if last is not None and last >= began else 0.0
            wait = min(max(wait, 0.0), span)
        self._backward += span - wait
        self._wait += wait
        self._forward_end = None

    def optimizer_started(self) -> None:
        if self._forward_end is not None or self._forward_start is not None:
            self.backward_ended()  # its end was not seen (an engine's step): it ends here
        self._optimizer_start = self._clock()

    def finish(self, duration: float | None, data_wait: float | None
               ) -> tuple[float, ...] | None:
        """The step's phase seconds in :data:`PHASES` order (``data`` 0.0 where unknown) for a
        step of ``duration`` wall seconds, then ready for the next step; None without a
        forward."""
        try:
            if duration is None or self._step_start is None:
                return None
            now = self._clock()
            optimizer = max(now - self._optimizer_start, 0.0) if self._optimizer_start else 0.0
            issue = getattr(self._recorder, "issue", None)
            wall, runnable = issue.take() if issue is not None else (0.0, 0.0)
            backward = self._backward
            if self._on_cpu:  # the rest of the wall time: waiting, or not scheduled at all
                parts = self._forward + backward + optimizer
                host = max(now - self._step_start - parts, 0.0)
                comm = min(wall - runnable, max(duration - parts - host, 0.0))
                wait = max(duration - parts - host - comm, 0.0)
            else:
                comm = min(wall, backward)
                backward -= comm
                wait = self._wait
                host = max(duration - self._forward - backward - optimizer - comm - wait, 0.0)
            return (data_wait or 0.0, self._forward, backward, optimizer, host, wait, comm)
        finally:
            self.reset()


def on_cpu(params: Any) -> bool:
    """Every parameter is on the CPU (no parameter: False, the wall clock)."""
    devices = {getattr(p, "device", None) for p in params}
    return bool(devices) and all(d is not None and d.type == "cpu" for d in devices)
