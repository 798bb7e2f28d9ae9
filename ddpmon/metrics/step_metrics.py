"""Per-step metrics: a catalogue entry and the function that computes its value from the step.

Adding one is its declaration in ``ddpmon/metrics.py`` (a gauge: the last step's value; or a
counter: the per-step values added up) and a ``StepMetric`` in ``AVAILABLE`` that computes it.
Each costs a series per rank, so they are opt-in by name (``Config.step_metrics``). The step
pipeline gives each a slot of the step vector (a device value) or carries it on the host (a
float), ``build_record`` puts it in ``StepRecord.step_values``, ``MetricState`` keeps or adds it,
and the collector exposes it: none of them names the metric.

A computation runs on the training thread at every optimizer step, so it follows the agent's
rules: a device value stays a tensor (never ``.item()``), a host value is returned as a float
only when it is on the host already, and anything it raises is counted under the ``step`` probe
(``ddpmon_agent_errors_total``), never raised into the loop. A value that needs a pass over the
gradients belongs to the gradient source's one fused pass instead (``GradSummaries``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import metrics
from ..host_reads import host_read_free
from . import Metric, MetricType
from .step_slots import Slot

__all__ = ["AVAILABLE", "StepInputs", "StepMetric", "chosen", "evaluate", "learning_rate"]


@dataclass(frozen=True, slots=True)
class StepInputs:
    """What a per-step computation can read: the step's index, the optimizer the agent was
    attached with, the loss handed to ``observe_loss`` (a tensor or a float, or None), and the
    gradient source's results (``strategies.base.GradSummaries``)."""

    step: int
    optimizer: Any
    loss: torch.Tensor | float | None
    summaries: Any


Value = torch.Tensor | float | None


@dataclass(frozen=True, slots=True)
class StepMetric:
    name: str
    """What ``Config.step_metrics`` calls it."""
    metric: Metric
    compute: Callable[[StepInputs], Value]
    """Training thread, every step: a one-element tensor (read back with the step's other
    values), a float (a host value), or None (no value this step)."""

    def __post_init__(self) -> None:
        if self.metric.type not in (MetricType.GAUGE, MetricType.COUNTER) or self.metric.labels:
            raise ValueError(
                f"{self.metric.name}: a per-step metric is an unlabelled gauge or counter"
            )

    @property
    def slot(self) -> Slot:
        """Its slot in the step vector, named after the metric."""
        return Slot(self.metric.name, 1, self.metric.help)


def learning_rate(inputs: StepInputs) -> Value:
    """The first parameter group's ``lr`` at the optimizer step. Schedulers step after
    ``optimizer.step()``, so this is the rate the step used. A tensor lr on a device stays
    there; one on the CPU is a host value (reading it is no device sync)."""
    groups = getattr(inputs.optimizer, "param_groups", None)
    if not groups:
        return None
    lr = groups[0].get("lr") if isinstance(groups[0], dict) else None
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            return None
        return float(lr) if host_read_free(lr.device) else lr.detach().reshape(1)
    return float(lr) if isinstance(lr, int | float) else None


AVAILABLE: dict[str, StepMetric] = {
    entry.name: entry
    for entry in (StepMetric("learning_rate", metrics.LEARNING_RATE, learning_rate),)
}
"""Every per-step metric, by the name ``Config.step_metrics`` turns it on with."""


def evaluate(
    entries: Sequence[StepMetric], inputs: StepInputs, guard: Any, values: dict
) -> tuple[dict[str, Metric] | None, dict[Metric, float] | None]:
    """Each entry's value this step: a tensor joins ``values`` (the step vector) under its slot,
    a float rides on the host; one that raises is counted under ``guard``'s ``step`` probe and
    left out. Returns (slot name -> metric of the queued ones, metric -> host value)."""
    queued: dict[str, Metric] = {}
    on_host: dict[Metric, float] = {}
    for entry in entries:
        with guard("step"):
            value = entry.compute(inputs)
            if isinstance(value, torch.Tensor):
                values[entry.slot.name] = value.detach().reshape(-1)[:1]
                queued[entry.slot.name] = entry.metric
            elif value is not None:
                on_host[entry.metric] = float(value)
    return queued or None, on_host or None


def chosen(names: tuple[str, ...]) -> tuple[StepMetric, ...]:
    """The per-step metrics a rank computes (``Config.step_metrics``, validated there)."""
    return tuple(AVAILABLE[name] for name in names)
