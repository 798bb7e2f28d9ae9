"""The step in progress as an exit path sees it: its number and phase, kept where a signal's
dump finds them (the crash files' live line), and what its hooks saw, for an exception's exit
event (:mod:`.inflight`). A part of ``StepPipeline``; its state is the pipeline's."""

from __future__ import annotations

from typing import Any

from ..forensics.live_step import CHECKPOINT
from ..state import StepRecord
from ..strategies.base import GradSummaries


class StepPhase:
    """Mixed into ``StepPipeline`` (which sets ``step``, ``phase``, ``live``, ``source``, the
    tracker and the records lock)."""

    step: int
    phase: int
    live: Any
    source: Any
    tracker: Any
    _outside_checkpoint: int
    _forward_seen: bool
    _backward_pending: bool
    _collected: GradSummaries | None
    _loss: Any
    _records_lock: Any

    def keep_live(self, live: Any) -> None:
        """Keep the step in progress in ``live`` (the crash capture's ``LiveStep``) from now."""
        self.live = live
        live.set(self.step, self.phase)

    def _at(self, phase: int) -> None:  # hot path: a host store, one mapped write
        self.phase = phase
        self.live.set(self.step, phase)

    def in_checkpoint(self, inside: bool) -> None:
        """A checkpoint save or load began (``inside``) or ended on the training thread."""
        if inside:
            self._outside_checkpoint = self.phase
        self._at(CHECKPOINT if inside else self._outside_checkpoint)

    @property
    def started(self) -> bool:
        """A first step has started (a forward, a backward or a completed step was seen)."""
        return bool(self.step or self._forward_seen or self._backward_pending)

    def in_flight(self) -> tuple[GradSummaries | None, Any]:
        """Exit path only: what the source has seen of the step in progress and its observed
        loss (device tensors, not read here)."""
        if self._collected is not None:
            return self._collected, self._loss
        inflight = getattr(self.source, "inflight", None)
        return (inflight() if inflight is not None else None), self._loss

    def classify(self, record: StepRecord) -> None:
        """The origin rule for a record built outside ``drain`` (the step in flight)."""
        with self._records_lock:
            self.tracker.classify(record)
