"""The wait for the other ranks measured on the device (CUDA), read on the record thread.

With NCCL, DDP's ``work.wait()`` at the backward's end only makes the compute stream wait for the
communication stream: the host returns at once, so the host-side ``wait`` of ``step_split``
(the backward's last collective issued to its end) is near 0 on every rank and the time a fast
rank waits for a slow GPU lands wherever the host first synchronises. The collective recorder
already times each collective with a pair of CUDA events: the start on the stream that produced
the bucket (it fires when the bucket's gradients are computed on the device), the end when the
collective completes. For the step's last collective that span is the device's wait: on a fast
rank, waiting for the slow one plus the transfer; on the slow rank, the transfer alone.

So on the record thread (the step's values have reached the host, its events have completed;
nothing is read on the training thread) the step's ``wait`` is raised to that span, and the
time added is taken out of the parts where the host would have absorbed it, in turn: ``host``,
``optimizer``, ``backward``, ``forward``. The step's parts keep their sum. On CPU no event is
recorded and nothing changes.
"""

from __future__ import annotations

from typing import Any

from ..probes.comm import CommTiming


def device_wait(timing: CommTiming | None) -> float | None:
    """Seconds between the start and end events of the step's last collective issued (CUDA),
    or None: no event (CPU), or its end not recorded (the collective's future never ran)."""
    start = getattr(timing, "last_start", None)
    if start is None:
        return None
    for _op, first, end in timing.events:  # type: ignore[union-attr]
        if first is start:
            try:
                return max(start.elapsed_time(end) / 1000.0, 0.0)
            except Exception:  # not recorded: resolve() counts it for the collective's timing
                return None
    return None


def with_device_wait(phases: tuple[float, ...] | None, wait: float | None
                     ) -> tuple[float, ...] | None:
    """``phases`` (``step_split.PHASES`` order) with ``wait`` raised to the device's, the added
    seconds taken out of host, optimizer, backward and forward in turn (never below 0)."""
    if phases is None or wait is None or wait <= phases[5]:
        return phases
    data, forward, backward, optimizer, host, host_wait, comm = phases
    left = wait - host_wait
    parts = [host, optimizer, backward, forward]
    for i, value in enumerate(parts):
        taken = min(value, left)
        parts[i] = value - taken
        left -= taken
    host, optimizer, backward, forward = parts
    return (data, forward, backward, optimizer, host, wait - left, comm)


def resolve_into(record: Any, timing: CommTiming | None) -> None:
    """The record's ``phase_seconds`` with the device wait of its collectives (record thread)."""
    record.phase_seconds = with_device_wait(record.phase_seconds, device_wait(timing))
