"""The gradient norm a trainer reports (``observe_grad_norm``), compared with ddpmon's own.

A trainer may report the norm of a step before, with or after that step's record is built on
the record thread (a logging callback runs after the optimizer step; Lightning logs every N
steps). Both sides are kept by step, at most 64 each, until both are known; a mismatch found
with the record is the record's (``grad_norm_mismatch``), one found later goes to the sinks'
``on_late_cross_check``.

A norm for the step in progress (or a later one), or any tensor, is queued with the step's
values (``take_queued``): a tensor is read with them, lazily, never on the training thread.
Everything that compares holds the step flow's records lock (``lock``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..metrics.state import StepRecord
from .observed import plain
from .policy import as_float, norm_mismatch

KEPT = 64
"""Steps kept on each side while the other is awaited."""


class TrainerNorms:
    def __init__(
        self, tolerance: float, sinks: Callable[[], Sequence[Any]], guard: Any, lock: Any
    ) -> None:
        self.tolerance = tolerance
        self._sinks = sinks
        self._guard = guard
        self._lock = lock
        self._ours: OrderedDict[int, float] = OrderedDict()
        self._theirs: OrderedDict[int, float] = OrderedDict()
        self._queued: tuple[Any, int] | None = None
        """The norm to queue with the step in progress, and the step it is for."""

    def observe(self, value: Any, step: int, current: int) -> None:
        """A trainer norm for ``step`` while step ``current`` is in progress (training
        thread): queued with the step's values, or, for an earlier step given as a number,
        compared now."""
        if isinstance(value, torch.Tensor):
            whole = plain(value)
            if whole is not None:  # None: a one-element Shard another rank holds
                self._queued = (whole, step)
            return
        number = as_float(value)
        if number is None:
            return
        if step >= current:
            self._queued = (number, step)
            return
        with self._lock:
            self.reported(step, number)

    def take_queued(self) -> tuple[torch.Tensor | None, float | None, int | None]:
        """The queued norm as (a one-element tensor, or a host number; the step it is for),
        and forget it. Training thread, at the step's end."""
        if self._queued is None:
            return None, None, None
        (value, step), self._queued = self._queued, None
        if isinstance(value, torch.Tensor):
            return (value if value.numel() == 1 else value.reshape(-1)[:1]), None, step
        return None, value, step

    def flush(self) -> None:
        """At close: a norm reported after the last step is read now (one read, once)."""
        if self._queued is None:
            return
        (value, step), self._queued = self._queued, None
        number = as_float(value.item() if isinstance(value, torch.Tensor) else value)
        if number is not None:
            with self._lock:
                self.reported(step, number)
                self.compare_pending()

    def reported(self, step: int, theirs: float) -> None:
        """A trainer norm for a step whose record may or may not have been built yet."""
        if step in self._ours:
            self._compare_late(step, theirs)
        else:
            self._theirs[step] = theirs
            while len(self._theirs) > KEPT:
                self._theirs.popitem(last=False)

    def with_record(self, record: StepRecord, theirs: float | None, target: int | None) -> None:
        """``record`` was built; ``theirs`` is the trainer norm queued with it, for ``target``."""
        if record.grad_norm is not None:
            self._ours[record.step] = record.grad_norm
            while len(self._ours) > KEPT:
                self._ours.popitem(last=False)
        if theirs is not None and target is not None and target != record.step:
            self._theirs[target] = theirs  # a norm for another step: compare it there
            theirs = None
        late = self._theirs.pop(record.step, None)
        theirs = late if theirs is None else theirs
        if theirs is not None:
            record.trainer_grad_norm = theirs
            record.grad_norm_mismatch = norm_mismatch(record.grad_norm, theirs, self.tolerance)
        self.compare_pending()

    def compare_pending(self) -> None:
        """Compare trainer norms whose step's record has arrived (kept until it does)."""
        for step in [s for s in self._theirs if s in self._ours]:
            self._compare_late(step, self._theirs.pop(step))

    def _compare_late(self, step: int, theirs: float) -> None:
        """A trainer norm for a step whose record was already delivered."""
        ours = self._ours.get(step)
        mismatch = norm_mismatch(ours, theirs, self.tolerance)
        for sink in self._sinks():
            handler = getattr(sink, "on_late_cross_check", None)
            if handler is not None:
                with self._guard(sink.probe):
                    handler(step, ours, theirs, mismatch)
