"""A step's record from its read-back values: global and group norms, the local norms and their
non-finite flags, loss, scaler facts, collectives, and the strategy's own finish (its
``StepExtension``).
Runs on the record thread (``StepFlow.drain``); nothing here touches a device."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..metrics import Metric
from ..metrics import step_slots as slot
from ..metrics.state import StepRecord
from ..probes.grads import ParamIndex, summarize_host
from ..strategies.base import GradSummaries, NormVector
from .device_wait import resolve_into
from .guard import Guard


@dataclass(slots=True)
class StepMeta:
    """Host-side facts about one queued step vector."""

    step: int
    wall_time: float
    duration: float | None
    data_wait: float | None
    summaries: GradSummaries
    """The step's device results, as the source collected them (their vectors' positions, the
    collectives, the strategy's extension)."""
    loss_host: float | None
    trainer_norm_host: float | None
    trainer_norm_step: int | None
    skipped_by: str | None
    host_skipped: bool | None = None
    """Skipped by the optimizer's own overflow check, known on the host (an engine's counters)."""
    host_scale_after: float | None = None
    """The loss scale after the step, a host value (an engine's fp16 scaler keeps it as a float)."""
    step_metrics: dict[str, Metric] | None = None
    """The per-step metrics queued in the step vector this step, by slot name."""
    step_values_host: dict[Metric, float] | None = None
    """The per-step metrics whose value was on the host already."""
    replica_check: Any = None
    """The replica checksums' gather issued at this step's end (``strategies.replicas``)."""
    extras: Any = None
    """``agent.update_wiring.SpikeParts``: finishes the record from its own slots."""
    phases: tuple[float, ...] | None = None
    """The step's phase seconds (``step_split.PHASES`` order), None where unknown."""
    fields: tuple[dict | None, dict | None] | None = None
    """The computed step fields (``step_fields.COMPUTED``): (slot name -> field of the queued
    ones, field -> host value)."""


def build_record(
    parts: dict[str, list[float]],
    meta: StepMeta,
    index: ParamIndex,
    guard: Guard,
    reduction_failed: bool = False,
) -> StepRecord:
    """One step's record from its read-back values (``parts``) and host facts (``meta``);
    ``reduction_failed``: its host-side norm reduction failed, so it has no global norm. Record
    thread."""
    record = StepRecord(
        step=meta.step,
        wall_time=meta.wall_time,
        duration_seconds=meta.duration,
        data_wait_seconds=meta.data_wait,
        phase_seconds=meta.phases,
        skipped_by=meta.skipped_by,
    )
    scale = parts[slot.GRAD_SCALE][0] if slot.GRAD_SCALE in parts else None
    summaries = meta.summaries
    extension = summaries.extension
    # reported where it failed: no global norm this step
    reduced_vector = None if reduction_failed else summaries.reduced
    reduced = local = None
    if slot.REDUCED_NORMS in parts and reduced_vector is not None:
        reduced = summarize_host(reduced_vector, parts[slot.REDUCED_NORMS], index, scale)
        record.group_norms = dict(zip(index.group_names, reduced.group_norms, strict=True))
        record.grad_nonfinite = reduced.nonfinite
        if reduced.nonfinite:
            record.grad_nonfinite_param = index.name(reduced.first_position)
            record.grad_nonfinite_kind = reduced.kind
    # the one writer of the global norm: the strategy's own where the reduced norms are not it
    if extension is not None and extension.replaces_global_norm:
        record.grad_norm = extension.global_norm(parts)
        if record.grad_norm is not None and not math.isfinite(record.grad_norm):
            record.grad_nonfinite = True
    elif reduced is not None:
        record.grad_norm = reduced.norm
    if slot.LOCAL_NORMS in parts and summaries.local is not None:
        local = summarize_host(summaries.local, parts[slot.LOCAL_NORMS], index, scale)
    elif summaries.local_is_reduced:
        local = reduced
    if local is not None:
        if summaries.local_complete:
            record.grad_local_norm = local.norm
        record.local_nonfinite = local.nonfinite
        if local.nonfinite:
            record.local_nonfinite_param = index.name(local.first_position)
            record.local_nonfinite_kind = local.kind
    record.loss = parts[slot.LOSS][0] if slot.LOSS in parts else meta.loss_host
    if slot.LOSS_SCALE in parts:
        record.loss_scale = parts[slot.LOSS_SCALE][0]
    if slot.FOUND_INF in parts and parts[slot.FOUND_INF][0] > 0:
        record.amp_skipped = True
        record.skipped_by = record.skipped_by or "scaler"
    if meta.host_scale_after is not None:
        record.loss_scale = meta.host_scale_after
    if meta.host_skipped:
        # The engine skipped the step: its loss scaler under fp16 (a scale after the step), its
        # own overflow check under bf16/fp32 (no scale at all).
        if meta.host_scale_after is not None:
            record.amp_skipped = True
            record.skipped_by = record.skipped_by or "scaler"
        else:
            record.skipped_by = record.skipped_by or "engine"
    if slot.IDENTICAL_RANKS in parts:
        record.data_identical_ranks = int(parts[slot.IDENTICAL_RANKS][0])
    if summaries.comm is not None:
        with guard("comm"):
            record.collective_bytes = dict(summaries.comm.bytes)
            record.collective_seconds = summaries.comm.resolve(guard.error)
            resolve_into(record, summaries.comm)  # CUDA: the wait measured on the device
    if meta.step_values_host:
        record.step_values.update(meta.step_values_host)
    for name, metric in (meta.step_metrics or {}).items():
        if name in parts:
            record.step_values[metric] = parts[name][0]
    if meta.fields is not None:
        queued, on_host = meta.fields
        for field, value in (on_host or {}).items():
            setattr(record, field.name, value)
        for name, field in (queued or {}).items():
            if name in parts:
                setattr(record, field.name, parts[name][0])
    if meta.extras is not None:
        meta.extras.finish(record, parts, index, guard)
    if meta.replica_check is not None:
        with guard("comm"):
            divergence = meta.replica_check.compare()
            if divergence is not None:
                record.replica_divergence = dataclasses.asdict(divergence)
    if extension is not None:
        host_reduced = _host(parts, slot.REDUCED_NORMS, reduced_vector)
        host_local = _host(parts, slot.LOCAL_NORMS, summaries.local)
        extension.finish(
            record, parts, host_local or (host_reduced if summaries.local_is_reduced else None),
            host_reduced,
        )
    return record


def _host(parts: dict, name: str, vector: NormVector | None) -> tuple | None:
    """(host values, positions) of a read-back norm vector, or None."""
    if name not in parts or vector is None:
        return None
    return parts[name], list(vector.positions)
