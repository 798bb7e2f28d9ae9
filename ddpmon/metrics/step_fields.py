"""Every field of a step record, declared once: its name and type, how it folds into the rank's
metric state (last value, a count of steps, a histogram), its /metrics series, its history
column and whether the summary carries it.

``state.StepRecord`` and the folded part of ``state.MetricState`` are generated from
:data:`STEP_FIELDS`; ``MetricState.apply``, the collector (``export.collector``), the history
schema and rows (``forensics.history_schema``, ``forensics.history``), ``compare``, ``report``
and the summary (``agent.sinks.SummarySink``) iterate over it. A new step value is its
declaration here plus its computation (``compute``, run on the training thread like a per-step
metric: a device value joins the step vector and is read back with the step's others), and
its catalogue entry where it has a series (docs/architecture.md, "Add a step field").

Hand-written code remains only where a field needs more than a fold (say so in ``fold``):
dict-valued fields (group norms, collectives, update statistics), the skip's ``by`` label, the
first non-finite step, and the loss scale (exported only under AMP).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import metrics as m
from .step_slots import Slot

STEP_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DATA_WAIT_SECONDS_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)


class Fold(enum.Enum):
    """How a record's value folds into ``MetricState``."""

    NONE = "none"
    """Not folded generically (kept on the record, or folded by hand in ``MetricState``)."""
    LAST = "last"
    """The last value that was not None (a gauge)."""
    COUNT = "count"
    """Steps where the value is truthy (a counter from 0)."""
    HISTOGRAM = "histogram"
    """Observed into a fixed-bucket histogram (``buckets``)."""


@dataclass(frozen=True, slots=True)
class StepField:
    name: str
    """The ``StepRecord`` attribute (and the history column, when it has one)."""
    dtype: Any
    """Its Python type (the annotation of the generated ``StepRecord``)."""
    default: Any = None
    """Its default (a dict or list field: ``factory``); ``REQUIRED``: passed at construction."""
    factory: Callable[[], Any] | None = None
    fold: Fold = Fold.NONE
    state: str | None = None
    """The ``MetricState`` attribute it folds into (``Fold.LAST``: defaults to ``name``)."""
    metric: m.Metric | None = None
    """Its /metrics series, exported from ``state`` (None: not exported, or by hand)."""
    buckets: tuple[float, ...] = ()
    column: str | None = None
    """Its history column's Arrow type (``float32``, ``bool_``...); None: not in the history."""
    column_doc: str = ""
    """What the column holds (``docs/reference/files.md``)."""
    summary: str | None = None
    """Its key in ``summary.rank<R>.json`` (the folded state value); None: not carried."""
    compare: bool = False
    """``ddpmon compare`` compares its column (from the lowest rank), and ``report`` plots it
    under "Step values"; the core fields' own comparisons and plots are written by hand."""
    compute: Callable[[Any], Any] | None = None
    """A step value computed on the training thread from ``step_metrics.StepInputs``: a
    one-element tensor (read back with the step's other values), a float, or None."""

    @property
    def state_name(self) -> str:
        return self.state or self.name

    @property
    def slot(self) -> Slot:
        """A computed field's slot in the step vector."""
        return Slot(f"field:{self.name}", 1, self.column_doc or self.name)


REQUIRED = object()
"""``StepField.default`` of a field the record is always built with."""

_F32, _BOOL = "float32", "bool_"

STEP_FIELDS: tuple[StepField, ...] = (
    StepField("step", int, REQUIRED, column="int64",
              column_doc="optimizer step (the loop's own counter)"),
    StepField("wall_time", float, REQUIRED, column="float64",
              column_doc="`time.time()` when the step completed"),
    StepField("duration_seconds", float | None, REQUIRED, fold=Fold.HISTOGRAM,
              state="step_duration", metric=m.STEP_DURATION, buckets=STEP_SECONDS_BUCKETS,
              column=_F32, column_doc="step time"),
    StepField("data_wait_seconds", float | None, REQUIRED, fold=Fold.HISTOGRAM,
              state="data_wait", metric=m.DATA_WAIT, buckets=DATA_WAIT_SECONDS_BUCKETS,
              column=_F32,
              column_doc="end of the previous step to the first forward of this one"),
    StepField("loss", float | None, fold=Fold.LAST, metric=m.LOSS, column=_F32,
              column_doc="this rank's loss of the step (`observe_loss`, an integration), "
              "unscaled; null when not reported (a `Partial` DTensor loss: this rank's share, "
              "the ranks' mean is the full loss)", summary="loss"),
    StepField("grad_norm", float | None, fold=Fold.LAST, metric=m.GRAD_NORM, column=_F32,
              column_doc="global L2 norm of the reduced, unscaled gradients, before clipping",
              summary="grad_norm"),
    StepField("grad_local_norm", float | None, fold=Fold.LAST, metric=m.GRAD_LOCAL_NORM,
              column=_F32,
              column_doc="this rank's norm before the reduction (null when not measured that "
              "step)", summary="grad_local_norm"),
    StepField("group_norms", dict[str, float], factory=dict),  # by hand: a list column
    StepField("grad_nonfinite", bool, False, fold=Fold.COUNT,
              state="grad_nonfinite_steps_total", metric=m.GRAD_NONFINITE_STEPS, column=_BOOL,
              column_doc="the reduced gradients held NaN/Inf", summary="grad_nonfinite_steps"),
    StepField("grad_nonfinite_param", str | None),
    StepField("grad_nonfinite_kind", str | None),
    StepField("local_nonfinite", bool, False, column=_BOOL,
              column_doc="this rank's local gradients held NaN/Inf"),
    StepField("local_nonfinite_param", str | None),
    StepField("local_nonfinite_kind", str | None),
    StepField("loss_scale", float | None, fold=Fold.LAST, column=_F32,  # exported under AMP
              column_doc="AMP loss scale (null without a loss scaler)", summary="loss_scale"),
    StepField("amp_skipped", bool, False, fold=Fold.COUNT, state="amp_skipped_steps_total",
              column=_BOOL,
              column_doc="the loss scaler (a GradScaler or DeepSpeed fp16) skipped the step",
              summary="amp_skipped_steps"),
    StepField("collective_seconds", dict[str, list[float]], factory=dict),  # by hand: per op
    StepField("collective_bytes", dict[str, int], factory=dict),
    StepField("data_identical_ranks", int | None, fold=Fold.COUNT,
              state="data_identical_batches_total", metric=m.DATA_IDENTICAL_BATCHES),
    StepField("skipped_by", str | None, column="uint8",  # folded by hand: a label per skipper
              column_doc="who skipped the step: 0 none, 1 scaler, 2 policy "
              "(`on_nonfinite=skip`), 3 loop, 4 engine (DeepSpeed bf16/fp32)"),
    StepField("origin", bool, False, fold=Fold.COUNT,
              state="grad_nonfinite_origin_steps_total", metric=m.GRAD_NONFINITE_ORIGIN_STEPS,
              column=_BOOL,
              column_doc="this rank was an origin of non-finite gradients at this step",
              summary="grad_nonfinite_origin_steps"),
    StepField("poisoned", bool, False, fold=Fold.COUNT,
              state="grad_nonfinite_poisoned_steps_total",
              metric=m.GRAD_NONFINITE_POISONED_STEPS, column=_BOOL,
              column_doc="non-finite only because an earlier non-finite step was applied",
              summary="grad_nonfinite_poisoned_steps"),
    StepField("trainer_grad_norm", float | None),
    StepField("grad_norm_mismatch", bool, False, fold=Fold.COUNT,
              state="grad_norm_mismatch_total", metric=m.GRAD_NORM_MISMATCH,
              summary="grad_norm_mismatches"),
    StepField("pp_origin", dict | None),
    StepField("entry_block", str | None),
    StepField("entry_depth", int | None),
    StepField("origin_decided", bool, False),
    StepField("step_values", dict[Any, float], factory=dict),  # per-step metrics, by Metric
    StepField("phase_seconds", tuple[float, ...] | None),  # by hand: five history columns
    StepField("replica_divergence", dict | None),
    StepField("update_stats", dict[str, dict[str, float]] | None),
    StepField("logit_max", dict[str, float], factory=dict),
)
"""Every step field, in ``StepRecord`` order (``as_dict`` keeps it). What each holds:
``state.StepRecord``'s docstring."""

FOLDED = tuple(f for f in STEP_FIELDS if f.fold is not Fold.NONE)
EXPORTED = tuple(f for f in FOLDED if f.metric is not None)
IN_HISTORY = tuple(f for f in STEP_FIELDS if f.column is not None)
IN_SUMMARY = tuple(f for f in FOLDED if f.summary is not None)
COMPARED = tuple(f for f in IN_HISTORY if f.compare)
COMPUTED = tuple(f for f in STEP_FIELDS if f.compute is not None)


def state_default(f: StepField) -> Any:
    """The initial ``MetricState`` value of a folded field."""
    if f.fold is Fold.COUNT:
        return 0
    return None


def summary_values(state: Any) -> dict[str, Any]:
    """The summary's declared keys, from the folded state (``IN_SUMMARY`` order)."""
    return {f.summary: getattr(state, f.state_name) for f in IN_SUMMARY}
