"""Plain-Python metric state shared by the training thread (writer) and scrapes (readers).

Writers only assign attributes or bump list cells, which are atomic under the GIL, so a scrape
never waits for the training thread and the training thread never waits for a scrape.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from dataclasses import dataclass, field, make_dataclass
from typing import Any

from . import MetricType
from .step_fields import (  # noqa: F401  (the buckets re-exported: their old home)
    DATA_WAIT_SECONDS_BUCKETS,
    FOLDED,
    REQUIRED,
    STEP_FIELDS,
    STEP_SECONDS_BUCKETS,
    Fold,
    state_default,
)

COLLECTIVE_SECONDS_BUCKETS = (0.0005, 0.004, 0.032, 0.256)
"""Factor-8 bounds, 0.5 ms to 0.25 s: 8 series per op (5 buckets, sum, count and the bytes
counter), so a rank using four ops (PP+FSDP2) stays within the per-rank series budget with 32
groups. Coarse on purpose: quantiles are orders of magnitude; the exact mean per op is
``_sum / _count``, which the CollectiveSlow alert uses."""

CHECKPOINT_SECONDS_BUCKETS = (60.0,)
"""One bound: saves and loads are rare, and what is read of them is the mean (``_sum /
_count``, the slow-save alert) and the share over a minute. Each bucket is a series per kind and
rank; one bound keeps a rank that issues four collective ops (PP+FSDP2, DeepSpeed ZeRO-3)
within the 150-series budget."""
CHECKPOINT_KINDS = ("save", "load")


CORE_PROBES = ("grads", "comm", "amp", "loss", "step", "readback", "server", "forensics")


class Histogram:
    """Fixed-bucket histogram; counts are per bucket (not cumulative) so one observation is one
    list-cell increment, and rendering makes them cumulative, which keeps them monotonic."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        if not math.isfinite(value):
            return
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> tuple[list[tuple[str, float]], float, int]:
        """``(buckets, sum, count)`` in prometheus_client's HistogramMetricFamily shape."""
        counts = list(self.counts)
        total_sum = self.sum
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip(self.bounds, counts, strict=False):
            running += count
            out.append((_bound_label(bound), running))
        running += counts[-1]
        out.append(("+Inf", running))
        return out, total_sum, running

    @property
    def count(self) -> int:
        return sum(self.counts)


def _bound_label(bound: float) -> str:
    return repr(float(bound))


def possible_skippers(deepspeed: bool, loss_scaler: bool, on_nonfinite: str) -> list[str]:
    """Who can skip this rank's optimizer steps (``ddpmon_steps_skipped_total``'s ``by``, each
    exported from 0): the loop under a torch optimizer (DeepSpeed counts its engine's steps),
    a loss scaler, DeepSpeed's own overflow check under bf16/fp32, the skip policy."""
    out = [] if deepspeed else ["loop"]
    if loss_scaler:
        out.append("scaler")
    elif deepspeed:
        out.append("engine")
    if on_nonfinite in ("skip", "rerun"):
        out.append("policy")
    return out


@dataclass(slots=True)
class FirstNonfinite:
    step: int
    param: str
    kind: str  # "nan" | "inf"


class _RecordMethods:
    __slots__ = ()

    def as_dict(self) -> dict:
        out = {}
        for name in self.__slots__:  # type: ignore[attr-defined]
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value):
                value = str(value)
            elif isinstance(value, dict):
                value = {getattr(k, "name", k): _jsonable(v) for k, v in value.items()}
            out[name] = value
        return out


def _record_field(f) -> tuple:
    if f.factory is not None:
        return (f.name, f.dtype, field(default_factory=f.factory))
    if f.default is REQUIRED:
        return (f.name, f.dtype)
    return (f.name, f.dtype, field(default=f.default))


StepRecord = make_dataclass(
    "StepRecord", [_record_field(f) for f in STEP_FIELDS], bases=(_RecordMethods,),
    slots=True,
)
StepRecord.__module__ = __name__
StepRecord.__doc__ = """One completed step as read back from the device: plain Python numbers only.
Generated from ``step_fields.STEP_FIELDS`` (one declaration per field). What the fields hold:

- ``collective_seconds``: ``op -> durations`` of the collectives timed during the step
  (``probes.comm.OPS``); ``collective_bytes``: ``op -> bytes``.
- ``skipped_by``: who skipped this optimizer step: ``scaler`` (a GradScaler or DeepSpeed fp16
  found Inf/NaN), ``engine`` (DeepSpeed's overflow check under bf16/fp32), ``policy``
  (``on_nonfinite='skip'``), ``loop`` (the user's loop never called ``optimizer.step()``).
- ``origin``: this rank's local gradients went non-finite while the weights entering the step
  were finite: the rank (and step) where a NaN/Inf started. ``poisoned``: local gradients
  non-finite only because an earlier non-finite step reached the weights.
- ``pp_origin``: pipeline parallel: where this rank's stage started a NaN/Inf (``stage``,
  ``microbatch``, ``site``: activation, output, activation_grad or param_grad; ``param``).
- ``entry_block``: tensor parallel: the block nearest the loss whose output gradient was
  non-finite on this rank (``strategies.block_entry``); ``entry_depth``: its place from the
  loss end (0: last). ``origin_decided``: the source classified origin/poisoned itself.
- ``step_values``: the per-step metrics' values (``ddpmon.metrics.step_metrics``), keyed by
  ``Metric``.
- ``phase_seconds``: where the step's time went: data, forward, backward, optimizer, host, wait
  (``agent.step_split.PHASES``); None where the step had no start.
- ``replica_divergence``: a replica check at this step found replicas that differ from their
  group's majority (``strategies.replicas.Divergence`` as a dict).
- ``update_stats``: a sampled step's per-group weight norm, update norm, update/weight ratio
  and moment norms (``probes.updates``; ``agent.update_records.FIELDS``).
- ``logit_max``: the largest output of each ``logit_modules`` module (``probes.logits``).
"""


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _state_field(f) -> tuple:
    if f.fold is Fold.HISTOGRAM:
        return (f.state_name, Histogram, field(default_factory=lambda: Histogram(f.buckets)))
    kind = int if f.fold is Fold.COUNT else f.dtype
    return (f.state_name, kind, field(default=state_default(f)))


_FoldedState = make_dataclass(
    "_FoldedState", [_state_field(f) for f in FOLDED], slots=True
)
_FoldedState.__module__ = __name__
"""The step fields' folded values (``step_fields.FOLDED``: a last value, a count of steps, a
histogram), named by their declarations' ``state``."""


@dataclass(slots=True)
class MetricState(_FoldedState):
    """Latest values and counters of one rank, exactly what the collector exposes: the folded
    step fields (generated: ``_FoldedState``) and what needs more than a fold."""

    step: int = -1
    steps_total: int = 0
    last_step_timestamp: float = 0.0
    started_at: float = field(default_factory=time.time)
    loss_nonfinite_total: int = 0
    group_norms: dict[str, float] = field(default_factory=dict)
    first_nonfinite: FirstNonfinite | None = None
    amp_enabled: bool = False
    loss_scale_floor: float = 1.0
    steps_skipped_total: dict[str, int] = field(default_factory=dict)
    """``by -> steps skipped``: the skippers this rank can have, each from 0
    (:func:`possible_skippers`)."""
    collective_bytes_total: dict[str, int] = field(default_factory=dict)
    """``op -> bytes``; an op appears at its first observation (only ops in use are exported)."""
    collective_duration: dict[str, Histogram] = field(default_factory=dict)
    """``op -> histogram``, created at the first observation of that op."""
    agent_errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CORE_PROBES, 0))
    """Pre-set to 0 for the core probes so ``increase()`` sees their first failure."""
    version: int = 0
    """Bumped after every change so the exposition cache knows when to re-render."""
    stall_threshold_seconds: float | None = None
    """The agent's ``stall_seconds``, exported so alerts compare against it; None: not set."""
    strategy: str = "plain"
    """Parallelism of the model: plain, ddp, fsdp2, hsdp, tp or fsdp2+tp (``rank_info`` label)."""
    precision: str = "fp32"
    """What the model trains in (``agent.precision.LABELS``; ``rank_info`` label)."""
    stage: str = ""
    """The pipeline stages this rank runs (the strategy's ``stage_label``: ``"1"``, ``"0,2"``),
    the ``stage`` label of its step parts, so the straggler rules compare it within its stage;
    empty (no label) without stages."""
    attempt: int = 0
    """Restart attempt of this process (0: first launch); see ``ddpmon.agent.checkpoints``."""
    checkpoint_last_step: int | None = None
    """Step of the last completed checkpoint save; None before the first."""
    checkpoint_last_timestamp: float | None = None
    checkpoint_size_bytes: int | None = None
    checkpoint_duration: dict[str, Histogram] = field(default_factory=dict)
    """``save``/``load`` -> histogram, created at the first observation of that kind."""
    step_values: dict[Any, float] = field(default_factory=dict)
    """The per-step metrics (``ddpmon.metrics.step_metrics``) by ``Metric``: a gauge's last value, a
    counter's sum."""
    replica_mismatch_total: int | None = None
    """Replica checks at which this rank differed from its replicas' majority; None where the
    check does not run (its series is then not exported)."""
    step_part_seconds_total: dict[str, float] = field(default_factory=dict)
    """``compute``/``wait``/``communication`` -> seconds summed over steps
    (``ddpmon_step_part_seconds_total``)."""
    step_reruns_total: dict[str, int] | None = None
    """Reruns by fault (``transient``, ``deterministic``) under ``on_nonfinite='rerun'``;
    None otherwise (not exported)."""
    update_ratios: dict[str, float] | None = None
    """The last sampled per-group update/weight ratios, exported only with ``update_series``
    (None: not exported; up to ``max_groups`` series)."""
    logit_max: dict[str, float] = field(default_factory=dict)
    """The last step's max logit per ``logit_modules`` module (opt-in)."""
    loss_spike_unrecovered_step: int | None = None
    """The step of a loss spike that has not recovered (``agent.spikes``); None: none, and
    no series."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    """Writers run on several threads (records, checkpoints, probe errors): one at a time."""

    def apply_checkpoint(
        self, kind: str, step: int, seconds: float, finished: float, size: int | None
    ) -> None:
        """Fold one completed checkpoint save or load into the state (any thread)."""
        if kind not in CHECKPOINT_KINDS:
            raise ValueError(f"checkpoint kind={kind!r}: expected one of {CHECKPOINT_KINDS}")
        with self._lock:
            self._apply_checkpoint(kind, step, seconds, finished, size)

    def _apply_checkpoint(
        self, kind: str, step: int, seconds: float, finished: float, size: int | None
    ) -> None:
        hist = self.checkpoint_duration.get(kind)
        if hist is None:
            hist = self.checkpoint_duration[kind] = Histogram(CHECKPOINT_SECONDS_BUCKETS)
        hist.observe(seconds)
        if kind == "save":
            self.checkpoint_last_step = int(step)
            self.checkpoint_last_timestamp = finished
            if size is not None:
                self.checkpoint_size_bytes = int(size)
        self.version += 1

    def apply(self, record: StepRecord) -> None:
        """Fold one step record into the state (the agent's record thread)."""
        with self._lock:
            self._apply(record)

    def _apply(self, record: StepRecord) -> None:
        self.step = record.step
        self.steps_total += 1
        self.last_step_timestamp = record.wall_time
        for f in FOLDED:
            value = getattr(record, f.name)
            if f.fold is Fold.LAST:
                if value is not None:
                    setattr(self, f.state_name, value)
            elif f.fold is Fold.COUNT:
                if value:
                    setattr(self, f.state_name, getattr(self, f.state_name) + 1)
            elif value is not None:  # Fold.HISTOGRAM
                getattr(self, f.state_name).observe(value)
        if record.phase_seconds is not None:
            _, forward, backward, optimizer, _, wait, comm = record.phase_seconds
            parts = self.step_part_seconds_total
            parts["compute"] = parts.get("compute", 0.0) + forward + backward + optimizer
            parts["wait"] = parts.get("wait", 0.0) + wait
            parts["communication"] = parts.get("communication", 0.0) + comm
        if record.loss is not None and not math.isfinite(record.loss):
            self.loss_nonfinite_total += 1
        if record.group_norms:
            self.group_norms = record.group_norms
        for op, nbytes in record.collective_bytes.items():
            self.collective_bytes_total[op] = self.collective_bytes_total.get(op, 0) + nbytes
        if record.origin and self.first_nonfinite is None:
            self.first_nonfinite = FirstNonfinite(
                record.step,
                record.local_nonfinite_param or "unknown",
                record.local_nonfinite_kind or "nan",
            )
        if record.skipped_by is not None:
            by = record.skipped_by
            self.steps_skipped_total[by] = self.steps_skipped_total.get(by, 0) + 1
        divergence = record.replica_divergence
        if divergence is not None and divergence.get("this_rank"):
            self.replica_mismatch_total = (self.replica_mismatch_total or 0) + 1
        if record.update_stats and self.update_ratios is not None:
            self.update_ratios = {g: f["update_ratio"] for g, f in record.update_stats.items()
                                  if "update_ratio" in f}
        if record.logit_max:
            self.logit_max = dict(record.logit_max)
        for metric, value in record.step_values.items():
            if metric.type is MetricType.COUNTER:
                value += self.step_values.get(metric, 0.0)
            self.step_values[metric] = value
        for op, durations in record.collective_seconds.items():
            hist = self.collective_duration.get(op)
            if hist is None:
                hist = self.collective_duration[op] = Histogram(COLLECTIVE_SECONDS_BUCKETS)
            for seconds in durations:
                hist.observe(seconds)
            self.collective_bytes_total.setdefault(op, 0)
        self.version += 1

    def set_spike_unrecovered(self, step: int | None) -> None:
        """A loss spike that did not recover (its step), or None once it has (any thread)."""
        with self._lock:
            self.loss_spike_unrecovered_step = step
            self.version += 1

    def collective_count(self) -> int:
        """Collectives timed so far, every op together."""
        return sum(h.count for h in list(self.collective_duration.values()))

    def count_error(self, probe: str) -> None:
        with self._lock:
            self.agent_errors[probe] = self.agent_errors.get(probe, 0) + 1
            self.version += 1

    def count_rerun(self, fault: str) -> None:
        """A step rerun under ``on_nonfinite='rerun'`` (training thread)."""
        with self._lock:
            reruns = self.step_reruns_total if self.step_reruns_total is not None else {}
            reruns[fault] = reruns.get(fault, 0) + 1
            self.step_reruns_total = reruns
            self.version += 1

    def count_mismatch(self) -> None:
        """A trainer norm that disagreed, found after its step's record was applied."""
        with self._lock:
            self.grad_norm_mismatch_total += 1
            self.version += 1

    def resume_at(self, step: int) -> None:
        """Steps count from ``step`` (a resume from a checkpoint, before the first step)."""
        with self._lock:
            self.step = step - 1
            self.version += 1
