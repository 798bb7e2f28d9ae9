"""Per-step metrics: a catalogue entry and the function that computes its value from the step.

Adding one is its catalogue declaration (a gauge: the last step's value; or a counter: the
per-step values added up) and an object with the :class:`PerStepMetric` protocol (a
:class:`StepMetric`) that computes it, passed as ``attach(..., step_metrics=[...])``; the
built-in ones (``AVAILABLE``) are also chosen by name. Each costs a series per rank, so they are
opt-in (``Config.step_metrics``). The step pipeline gives each a slot of the step vector (a
device value) or carries it on the host (a float), ``build_record`` puts it in
``StepRecord.step_values``, ``MetricState`` keeps or adds it, the collector exposes it and the
history writes it as a column of its own (``compare`` and ``report`` read it from there): none
of them names the metric.

A computation runs on the training thread at every optimizer step, so it follows the agent's
rules: a device value stays a tensor (never ``.item()``), a host value is returned as a float
only when it is on the host already, and anything it raises is counted under the ``step`` probe
(``ddpmon_agent_errors_total``), never raised into the loop. A value that needs a pass over the
gradients belongs to the gradient source's one fused pass instead (``GradSummaries``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from .. import metrics
from ..host_reads import host_read_free
from . import Metric, MetricType
from .step_fields import STEP_FIELDS
from .step_slots import Slot

NAME = re.compile(r"[a-z][a-z0-9_]{0,62}")
TAKEN_COLUMNS = frozenset(
    {f.name for f in STEP_FIELDS} | {"collective_count", "collective_mean_seconds",
     "collective_max_seconds", "memory_bytes", "forward_seconds", "backward_seconds",
     "optimizer_seconds", "host_seconds", "wait_seconds", "communication_seconds",
     "weight_norms", "update_norms",
     "update_ratios", "exp_avg_norms", "exp_avg_sq_norms", "skipped", "steps"}
)
"""Names a per-step metric's column may not take: the step fields and the history's derived
and per-group columns (``forensics.history_schema``, a layer above this module)."""

__all__ = [
    "AVAILABLE", "PerStepMetric", "StepInputs", "StepMetric", "chosen", "evaluate",
    "learning_rate",
]


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


@runtime_checkable
class PerStepMetric(Protocol):
    """What ``attach(..., step_metrics=[...])`` takes besides a built-in's name."""

    @property
    def name(self) -> str:
        """Its short name: the history column (``[a-z][a-z0-9_]*``)."""

    @property
    def metric(self) -> Metric:
        """Its catalogue entry: an unlabelled gauge or counter."""

    @property
    def slot(self) -> Slot:
        """Its slot in the step vector."""

    def compute(self, inputs: StepInputs) -> Value:
        """Training thread, every step (see :class:`StepMetric`)."""


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


_METRIC = object()


def evaluate(
    entries: Sequence[Any], inputs: StepInputs, guard: Any, values: dict, key: Any = _METRIC
) -> tuple[dict[str, Any] | None, dict[Any, float] | None]:
    """Each entry's value this step: a tensor joins ``values`` (the step vector) under its slot,
    a float rides on the host; one that raises is counted under ``guard``'s ``step`` probe and
    left out. Returns (slot name -> key of the queued ones, key -> host value); the key is the
    entry's ``metric`` (a per-step metric), or the entry itself with ``key=None`` (a computed
    step field, ``step_fields.COMPUTED``)."""
    queued: dict[str, Any] = {}
    on_host: dict[Any, float] = {}
    for entry in entries:
        with guard("step"):
            value = entry.compute(inputs)
            name = entry.metric if key is _METRIC else entry
            if isinstance(value, torch.Tensor):
                values[entry.slot.name] = value.detach().reshape(-1)[:1]
                queued[entry.slot.name] = name
            elif value is not None:
                on_host[name] = float(value)
    return queued or None, on_host or None


def chosen(entries: Sequence[str | PerStepMetric]) -> tuple[PerStepMetric, ...]:
    """The per-step metrics a rank computes (``Config.step_metrics``, validated there): a
    built-in's name resolved through ``AVAILABLE``, an object as it is."""
    return tuple(AVAILABLE[e] if isinstance(e, str) else e for e in entries)


def problem(entry: Any) -> str | None:
    """Why ``entry`` cannot be a per-step metric (None: it can)."""
    if not isinstance(entry, PerStepMetric):
        return f"{entry!r} has no name, metric, slot and compute (the PerStepMetric protocol)"
    if not isinstance(entry.name, str) or not NAME.fullmatch(entry.name):
        return f"name {entry.name!r}: expected lowercase letters, digits and _"
    if entry.name in TAKEN_COLUMNS:
        return f"name {entry.name!r} is a history column already"
    metric = entry.metric
    if metric.type not in (MetricType.GAUGE, MetricType.COUNTER) or metric.labels:
        return f"{metric.name}: a per-step metric is an unlabelled gauge or counter"
    return None
