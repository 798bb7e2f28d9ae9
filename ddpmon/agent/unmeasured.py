"""An empty norm is never silent: a step whose gradients exist but of which the strategy's
gradient source measured nothing (no global, group or local norm, hence no origin) counts a
``grads`` agent error, and the first one says why in the log."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ..strategies.base import GradSummaries
from .guard import Guard

log = logging.getLogger("ddpmon")


class UnmeasuredSteps:
    def __init__(self, guard: Guard, params: Sequence[torch.Tensor], strategy: str) -> None:
        self._guard = guard
        self._params = params
        self._strategy = strategy
        self._failures = 0
        self.told = False

    def check(self, s: GradSummaries, step: int) -> None:
        """Count (and the first time, say) a step whose gradients the source did not measure.
        Costs one look at each ``.grad`` only on such a step. A step whose measurement failed
        is not counted again: the failure was counted and said where it happened."""
        failures, self._failures = self._failures, self._guard.failures.get("grads", 0)
        if s.reduced is not None or s.local is not None or s.extension is not None:
            return
        if failures != self._failures:
            return
        if not any(p.grad is not None for p in self._params):
            return  # nothing to measure (dropped gradients, or the engine holds them)
        self._guard.count("grads")
        self._failures += 1
        if not self.told:
            self.told = True
            log.warning(
                "ddpmon: step %d has gradients but the %s gradient source measured none of them "
                "(no global, group or local norm, no origin). Every such step is counted in "
                'ddpmon_agent_errors_total{probe="grads"}; please report the model\'s '
                "parallelism (docs/parallelism.md).", step, self._strategy)
