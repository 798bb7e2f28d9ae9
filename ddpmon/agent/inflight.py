"""The step in flight, written when an exception leaves the training loop.

A step that raises (``clip_grad_norm_(error_if_nonfinite=True)``, a loss guard, a dataset's
``ValueError``, an out-of-memory error) never reaches ``optimizer.step()``, so the flow never
closes it: what its hooks saw (DDP's comm hook saw a rank's local NaN in that backward) would die
with the process. On the exit path (the crash capture's ``sys.excepthook``, before its ``exit``
event) this module:

1. delivers the completed steps still queued (the origin rule needs to know whether an earlier
   applied step poisoned the weights);
2. reads what the source has seen of the step in progress (``GradientSource.inflight``: device
   norm vectors, read here and only here: the step has failed) into a record, classifies it with
   the same ``OriginTracker`` as a completed step, and emits its ``nonfinite`` event with
   ``running: true`` and the phase (plus the evidence bundle of an origin, as for a completed
   step);
3. returns the step, its phase and the loss if one was observed, for the ``exit`` event.

A device value is read only once the work queued before it has finished (``READ_WAIT_SECONDS``):
the exit is never held up by a collective a failed peer will not complete.

A signal (SIGTERM, a fatal one) runs no Python: its dump's live line (:mod:`ddpmon.forensics.
live_step`) names the step and phase instead. Never raises: a failure here leaves the exit event
as it was.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from ..metrics.state import StepRecord
from ..probes.grads import summarize_host
from ..recorder.live_step import PHASES
from ..strategies.base import GradSummaries


class InFlight:
    """Reports the step in progress of one rank's flow at exit (``report``)."""

    def __init__(self, flow: Any, incidents: Any, emit: Any, guard: Any) -> None:
        self.flow = flow
        self.incidents = incidents
        self.emit = emit
        self.guard = guard

    def report(self) -> dict[str, Any]:
        """Fields for the ``exit`` event (``step``, ``phase``, ``running``, ``loss``); emits the
        step's ``nonfinite`` event first when its gradients were non-finite. {} when no step
        has started or anything fails."""
        p = self.flow
        try:
            if not p.started:
                return {}
            with self.guard("readback"):
                p.drain(wait=False)
            step, phase = p.step, PHASES.get(chr(p.phase), chr(p.phase))
            fields: dict[str, Any] = {"step": step, "phase": phase, "running": True}
            summaries, loss_value = p.in_flight()
            loss = _loss(loss_value)
            if loss is not None:
                fields["loss"] = loss if math.isfinite(loss) else str(loss)
            with self.guard("readback"):
                record = self._record(summaries, step)
                if record is not None:
                    p.classify(record)
                    self._emit_nonfinite(record, phase)
            return fields
        except Exception:
            return {}

    def _record(self, s: GradSummaries | None, step: int) -> StepRecord | None:
        if s is None:
            return None
        index = self.flow.index
        record = StepRecord(step=step, wall_time=time.time(), duration_seconds=None,
                            data_wait_seconds=None)
        reduced = local = None
        if s.reduced is not None:
            reduced = summarize_host(s.reduced, _host(s.reduced.norms), index)
            record.grad_nonfinite = reduced.nonfinite
            if reduced.nonfinite:
                record.grad_nonfinite_param = index.name(reduced.first_position)
                record.grad_nonfinite_kind = reduced.kind
        if s.local is not None:
            local = summarize_host(s.local, _host(s.local.norms), index)
        elif s.local_is_reduced:
            local = reduced
        if local is not None and local.nonfinite:
            record.local_nonfinite = True
            record.local_nonfinite_param = index.name(local.first_position)
            record.local_nonfinite_kind = local.kind
        return record if record.grad_nonfinite or record.local_nonfinite else None

    def _emit_nonfinite(self, r: StepRecord, phase: str) -> None:
        """The event a completed step's record gives (``sinks.IncidentSink``), marked as the
        step in flight."""
        if r.local_nonfinite:
            self.emit("nonfinite", r.step, param=r.local_nonfinite_param,
                      nonfinite=r.local_nonfinite_kind, origin=r.origin, poisoned=r.poisoned,
                      running=True, phase=phase)
            if r.origin and self.incidents is not None:
                self.incidents.write_evidence("nonfinite", r.step, r.local_nonfinite_param,
                                              running=True, phase=phase)
        else:
            self.emit("nonfinite", r.step, param=r.grad_nonfinite_param,
                      nonfinite=r.grad_nonfinite_kind, origin=False, where="reduced",
                      running=True, phase=phase)


READ_WAIT_SECONDS = 2.0
"""How long the exit path waits for a device's queued work before it reads a value: a step that
failed on one rank may leave a collective that never completes queued before the norms (the
exit event is then written without them, never held up)."""


def _settled(t: torch.Tensor) -> None:
    """Raise ``TimeoutError`` unless the work queued before ``t`` on its device's current stream
    finishes within ``READ_WAIT_SECONDS`` (a CPU tensor is always settled)."""
    if not t.is_cuda:
        return
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(t.device))
    deadline = time.monotonic() + READ_WAIT_SECONDS
    while not done.query():
        if time.monotonic() > deadline:
            raise TimeoutError("the device's queued work did not finish; values not read")
        time.sleep(0.005)


def _host(norms: torch.Tensor) -> list[float]:
    _settled(norms)
    return norms.detach().to("cpu", torch.float64).tolist()


def _loss(value: Any) -> float | None:
    """The observed loss as a host number (a device read: exit path only)."""
    try:
        if isinstance(value, torch.Tensor):
            _settled(value)
            return float(value.detach().reshape(-1)[0].to("cpu", torch.float64))
        return float(value) if value is not None else None
    except Exception:
        return None
