"""What a non-finite step means and what to do about it.

- ``NonFinitePolicy``: ``on_nonfinite='skip'|'raise'`` must decide before the optimizer step,
  so it reads one flag per step (the documented sync); ``record`` reads nothing.
- ``OriginTracker``: on the host, after readback. A rank is the *origin* of a non-finite step
  when its local gradients are non-finite and the weights entering the step were finite. Once a
  step with non-finite reduced gradients has been *applied* (no GradScaler, loop or policy
  skipped it) the weights are poisoned, and every later non-finite step is counted as poisoned,
  never as an origin. No pass over the weights: the decision uses what the steps already told.
  ``reset()`` (e.g. after a checkpoint load) makes the weights trusted again.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..errors import NonFiniteGradientError
from ..metrics.state import StepRecord
from ..probes.grads import ParamIndex, summarize_host
from ..strategies.base import NormVector, StepExtension


class NonFinitePolicy:
    def __init__(
        self, mode: str, index: ParamIndex, rank: int, emit: Callable[..., None]
    ) -> None:
        self.mode = mode
        self.index = index
        self.rank = rank
        self._emit = emit

    @property
    def reads(self) -> bool:
        return self.mode != "record"

    def before_step(
        self,
        reduced: NormVector | None,
        step: int,
        *,
        skip_allowed: bool,
        extra: StepExtension | None = None,
    ) -> bool:
        """True when the step was skipped (gradients dropped on every rank alike). ``extra``:
        the strategy's part of the step, whose ``decision_norm`` must be finite too (its
        whole-step norm) and whose ``elsewhere`` names where else a non-finite value was."""
        if self.mode == "record" or reduced is None:
            return False
        finite = torch.isfinite(reduced.norms).all()
        whole = extra.decision_norm() if extra is not None else None
        if whole is not None:
            finite = finite & torch.isfinite(whole.to(finite.device)).all()
        if bool(finite):  # the one documented host read
            return False
        summary = summarize_host(reduced, reduced.norms.tolist(), self.index)
        param, kind = self.index.name(summary.first_position), summary.kind
        if summary.first_position < 0:  # finite here: non-finite in the strategy's other part
            param, kind = (extra or StepExtension).elsewhere, "nan"
        if self.mode == "raise":
            self._emit("nonfinite", step, param=param, nonfinite=kind, action="raise")
            raise NonFiniteGradientError(
                f"ddpmon: non-finite gradient ({kind}) on rank {self.rank} at step "
                f"{step} in parameter {param}"
            )
        if not skip_allowed:
            return False
        # Reduced gradients are identical on every rank, so every rank decides the same.
        for p in self.index.params:
            p.grad = None
        self._emit("nonfinite", step, param=param, nonfinite=kind, action="skip")
        return True


class OriginTracker:
    def __init__(self) -> None:
        self.poisoned_since: int | None = None

    def classify(self, record: StepRecord) -> None:
        if record.local_nonfinite:
            if self.poisoned_since is None:
                record.origin = True
            else:
                record.poisoned = True
        if record.grad_nonfinite and record.skipped_by is None and self.poisoned_since is None:
            self.poisoned_since = record.step

    def reset(self) -> None:
        self.poisoned_since = None


def norm_mismatch(ours: float | None, theirs: float | None, tolerance: float) -> bool:
    """Does a trainer's reported norm differ from ours beyond ``tolerance`` (relative)?"""
    if ours is None or theirs is None:
        return False
    if not (math.isfinite(ours) and math.isfinite(theirs)):
        return math.isfinite(ours) != math.isfinite(theirs)
    return abs(ours - theirs) > tolerance * max(abs(ours), abs(theirs), 1e-12)


def as_float(value: Any) -> float | None:
    """A host number from a host value (never a tensor: those go through the step vector)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
