"""DeepSpeed's optimizer steps, found by wrapping ``engine.step`` on the instance: a call that
moves ``engine.global_steps`` is one optimizer step, skipped when ``engine.skipped_steps``
moved too. Host counters only: no device read. At a boundary call the source measures the
reduced gradients first; ``before_step``/``after_step`` let the rerun policy decide around
DeepSpeed's own step (``.rerun``). ``source``: the engine's ``DeepSpeedSource`` (it imports this
module, so it is not named here)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...errors import LossScaleFloorError, NonFiniteGradientError, is_deepspeed_min_scale

__all__ = ["EngineSteps", "StepFacts", "attached_engines"]

attached_engines: weakref.WeakSet[Any] = weakref.WeakSet()
"""Engines a live monitor is attached to (a second attach is refused)."""


@dataclass(slots=True)
class StepFacts:
    """Host facts of one DeepSpeed optimizer step, read from the engine's counters."""

    skipped: bool
    scale_after: float | None
    """fp16: DeepSpeed's loss scale after the step; None for bf16/fp32 (no scale at all)."""
    engine_step: int | None = None
    """``engine.global_steps`` before the step: its index by the engine's own count (after a
    ``load_checkpoint``, the step the checkpoint says)."""


class EngineSteps:
    """Wraps ``engine.step`` (instance attribute) to find optimizer steps; see the module doc.

    ``on_step(facts)`` is called after each ``engine.step()`` that ended an optimizer step."""

    def __init__(
        self,
        engine: Any,
        source: Any,
        on_step: Callable[[StepFacts], None],
        on_error: Callable[[str, BaseException], None],
        on_min_scale: Callable[[BaseException, float | None], None] | None = None,
    ) -> None:
        self.after_step: Callable[[bool], None] | None = None
        """Called after an ``engine.step`` that ended an optimizer step, with whether
        DeepSpeed skipped it."""
        self.on_call: Callable[[], None] | None = None
        """Called first in every ``engine.step`` (the step split's optimizer start)."""
        self.before_step: Callable[[], None] | None = None
        """Called at a boundary ``engine.step`` once the reduced norms are measured, before
        DeepSpeed steps (``on_nonfinite='rerun'``: ``.rerun``); its
        ``NonFiniteGradientError`` reaches the loop, anything else is counted."""
        self.engine = engine
        self.source = source
        self._on_step = on_step
        self._on_error = on_error
        self._on_min_scale = on_min_scale
        self._original = engine.step
        self._fp16 = source.facts.precision == "fp16"
        engine.step = self._step  # instance attribute shadows the method
        attached_engines.add(engine)

    def _scale(self) -> float | None:
        if not self._fp16:
            return None  # bf16/fp32: no loss scale at all (not 1.0)
        value = self.source.loss_scale()
        return float(value) if isinstance(value, (int, float)) else None

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.engine
        before = skipped = None
        boundary = False
        try:
            if self.on_call is not None:
                self.on_call()
            self.source.note_scale()
            boundary = engine.is_gradient_accumulation_boundary()
            if boundary:
                try:
                    self.source.measure_reduced()
                except Exception as exc:
                    self._on_error("grads", exc)
            before, skipped = engine.global_steps, engine.skipped_steps
        except Exception as exc:
            self._on_error("step", exc)
        if boundary and self.before_step is not None:
            try:
                self.before_step()
            except NonFiniteGradientError:
                raise  # on_nonfinite=rerun, deterministic: meant for the loop, on every rank
            except Exception as exc:
                self._on_error("step", exc)
        try:
            result = self._original(*args, **kwargs)
        except Exception as exc:
            if self._on_min_scale is not None and is_deepspeed_min_scale(exc):
                self._on_min_scale(exc, self._scale())  # records; raise mode re-raises chained
            raise
        if before is not None:
            try:
                if engine.global_steps != before:
                    if self.after_step is not None:
                        self.after_step(engine.skipped_steps != skipped)
                    self._on_step(StepFacts(engine.skipped_steps != skipped, self._scale(),
                                            int(before)))
            except LossScaleFloorError:
                raise  # on_loss_scale_floor=raise: the one exception meant for the loop
            except Exception as exc:
                self._on_error("step", exc)
        return result

    def close(self) -> None:
        if self.engine.__dict__.get("step") == self._step:
            del self.engine.step
        attached_engines.discard(self.engine)
