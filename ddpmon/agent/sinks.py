"""Where a step record goes once its values are on the host.

Each sink has one job and the same small protocol (``probe`` name for the guard, ``on_record``,
``close``; optionally ``on_batch_end`` after each drained batch and ``on_late_cross_check``).
The flow calls every sink inside ``guard(sink.probe)``, on the agent's record thread, so a
failing sink is counted and the others still run.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..metrics import COLLECTIVE_OPS
from ..metrics.state import MetricState, StepRecord
from ..metrics.step_fields import summary_values


@runtime_checkable
class Sink(Protocol):
    """What a record goes to; a user's own passes in with ``attach(..., sinks=[...])`` and runs
    on the record thread beside ddpmon's, under ``guard(probe)`` (a failure is counted in
    ``ddpmon_agent_errors_total{probe=...}``, never raised into training)."""

    probe: str

    def on_record(self, record: StepRecord) -> None: ...

    def close(self) -> None: ...


class MetricSink:
    """Folds records into the metric state the collector exposes."""

    probe = "step"

    def __init__(self, state: MetricState) -> None:
        self.state = state

    def on_record(self, record: StepRecord) -> None:
        self.state.apply(record)

    def on_late_cross_check(self, step: int, ours: Any, theirs: float, mismatch: bool) -> None:
        if mismatch:
            self.state.count_mismatch()

    def close(self) -> None:
        pass


class ProgressSink:
    """``progress.rank<R>.json``: the last completed step survives a SIGKILL. Written once per
    drained batch (the newest record), not once per step."""

    probe = "forensics"

    def __init__(self, progress: Any) -> None:
        self.progress = progress
        self._latest: StepRecord | None = None

    def on_record(self, record: StepRecord) -> None:
        self._latest = record

    def on_batch_end(self) -> None:
        latest, self._latest = self._latest, None
        if latest is not None:
            self.progress.update(latest.step, latest.wall_time)

    def close(self) -> None:
        self.on_batch_end()
        self.progress.close()


class IncidentSink:
    """Events and evidence for what went wrong: non-finite gradients (origin, consequence or
    poisoned), non-finite losses, absorbed overflows, the loss scale reaching its floor,
    duplicated data, a trainer norm that disagrees. Keeps the recent records for evidence."""

    probe = "eventlog"

    def __init__(
        self,
        *,
        emit: Callable[..., None],
        evidence: Any,
        rank: int,
        loss_scale_floor: float,
        param_grad: Callable[[str], Any],
        scaler_state: Callable[[], dict | None],
        floor_policy: Any = None,
        device: str = "",
    ) -> None:
        self._emit = emit
        self._device = device
        self._evidence = evidence
        self._rank = rank
        self._floor = loss_scale_floor
        self._param_grad = param_grad
        self._scaler_state = scaler_state
        self._floor_policy = floor_policy
        """``agent.floor.FloorPolicy``: its ``record`` mode is decided here, per record."""
        self._below_floor = False
        self._identical_seen = False
        self.recent: deque[StepRecord] = deque(maxlen=64)

    def on_record(self, r: StepRecord) -> None:
        self.recent.append(r)
        if r.local_nonfinite:
            self._emit(
                "nonfinite",
                r.step,
                param=r.local_nonfinite_param,
                nonfinite=r.local_nonfinite_kind,
                origin=r.origin,
                poisoned=r.poisoned,
                skipped_by=r.skipped_by,
                grad_local_norm=r.grad_local_norm,
                **_pp_fields(r.pp_origin),
                **_entry_fields(r),
            )
            if r.origin:
                self.write_evidence("nonfinite", r.step, r.local_nonfinite_param)
        elif r.grad_nonfinite:
            self._emit(
                "nonfinite",
                r.step,
                param=r.grad_nonfinite_param,
                nonfinite=r.grad_nonfinite_kind,
                origin=False,
                skipped_by=r.skipped_by,
            )
        if r.loss is not None and not math.isfinite(r.loss):
            self._emit("nonfinite", r.step, tensor="loss", nonfinite=str(r.loss), origin=False)
        if r.amp_skipped:
            self._emit("overflow", r.step, loss_scale=r.loss_scale, absorbed=True)
        elif r.skipped_by == "loop":
            self._emit("step_skipped", r.step, by="loop")
        if r.data_identical_ranks and not self._identical_seen:
            self._identical_seen = True
            self._emit("identical_data", r.step, other_ranks=r.data_identical_ranks)
        if r.grad_norm_mismatch:
            self._emit_mismatch(r.step, r.grad_norm, r.trainer_grad_norm)
        divergence = r.replica_divergence
        if divergence is not None and divergence.get("this_rank"):
            self._emit(
                "replica_mismatch", r.step, ranks=list(divergence["ranks"]),
                group=divergence["group"], replicas=divergence["replicas"], device=self._device,
                first_check=divergence["first_check"],
            )
        if r.loss_scale is not None:
            below = r.loss_scale <= self._floor
            if below and not self._below_floor:
                self._emit("scale_floor", r.step, loss_scale=r.loss_scale, floor=self._floor)
                self.write_evidence("scale_floor", r.step, None)
            self._below_floor = below
        if self._floor_policy is not None:
            self._floor_policy.on_record(r.step, r.loss_scale)

    def origin_steps(self) -> list[int]:
        """Recent steps at which this rank's local gradients were a non-finite origin."""
        return [r.step for r in list(self.recent) if r.origin]

    def on_late_cross_check(self, step: int, ours: Any, theirs: float, mismatch: bool) -> None:
        if mismatch:
            self._emit_mismatch(step, ours, theirs)

    def _emit_mismatch(self, step: int, ours: Any, theirs: Any) -> None:
        self._emit("grad_norm_mismatch", step, grad_norm=ours, trainer_grad_norm=theirs)

    def write_evidence(self, kind: str, step: int, param: str | None, **info: Any) -> None:
        if self._evidence is None:
            return
        tensors = {}
        if param is not None:
            grad = self._param_grad(param)
            if grad is not None:
                # The local gradient is gone after the reduction; this is the current one.
                tensors[f"{param}.grad(reduced)"] = grad.detach()
        recent = list(self.recent)  # one copy: the watchdog thread writes evidence too
        latest = recent[-1].as_dict() if recent else None
        head = {"kind": kind, "rank": self._rank, "step": step, "param": param, "record": latest}
        self._evidence.write(
            kind,
            step,
            {**head, **info},
            tensors=tensors,
            records=[r.as_dict() for r in recent],
            extra={"scaler": self._scaler_state()},
        )

    def close(self) -> None:
        pass


class SummarySink:
    """``summary.rank<R>.json`` at close: where the rank got to, in one small file."""

    probe = "summary"

    def __init__(
        self,
        *,
        path: Path | None,
        state: MetricState,
        head: Callable[[], dict],
        write_json: Callable[[Path, Any], None],
    ) -> None:
        self._path = path
        self._state = state
        self._head = head
        self._write = write_json
        self._collectives: dict[str, deque[float]] = {}

    def on_record(self, record: StepRecord) -> None:
        for op, seconds in record.collective_seconds.items():
            recent = self._collectives.get(op)
            if recent is None:
                recent = self._collectives[op] = deque(maxlen=4096)
            recent.extend(seconds)

    def quantile(self, q: float, op: str | None = None) -> float | None:
        """Quantile of the recent collective times of ``op`` (every op when None)."""
        if op is None:
            recent = sorted(t for d in self._collectives.values() for t in d)
        else:
            recent = sorted(self._collectives.get(op, ()))
        return recent[min(len(recent) - 1, int(q * len(recent)))] if recent else None

    def collectives(self) -> dict[str, dict]:
        """Per op: count, p50 and p99 seconds of the recent ones (ops in exposition order)."""
        out = {}
        for op, hist in sorted(
            self._state.collective_duration.items(),
            key=lambda kv: COLLECTIVE_OPS.index(kv[0]) if kv[0] in COLLECTIVE_OPS else 99,
        ):
            out[op] = {
                "count": hist.count,
                "p50_seconds": self.quantile(0.5, op),
                "p99_seconds": self.quantile(0.99, op),
                "bytes": self._state.collective_bytes_total.get(op, 0),
            }
        return out

    def close(self) -> None:
        if self._path is None:
            return
        s = self._state
        first = s.first_nonfinite
        summary = {
            **self._head(),
            "steps": s.steps_total,
            "last_step": s.step,
            **summary_values(s),  # the declared step fields (step_fields.IN_SUMMARY)
            "first_nonfinite": (
                {"step": first.step, "param": first.param, "kind": first.kind} if first else None
            ),
            "steps_skipped": dict(s.steps_skipped_total),
            "skipped_steps": sum(s.steps_skipped_total.values()),
            "collective_p50_seconds": self.quantile(0.5),
            "collective_p99_seconds": self.quantile(0.99),
            "collective_count": s.collective_count(),
            "collectives": self.collectives(),
            "agent_errors": dict(s.agent_errors),
            "strategy": s.strategy,
        }
        self._write(self._path, summary)


class ManifestSink:
    """Writes this rank's manifest at attach, then once more, whole: after the first step
    (batch shapes and a resume's recovery are known then), or at close for a run that never
    completed one. The write at attach is what a run killed before its first step (SIGKILL,
    scancel, a segfault in the first forward) leaves: who ran, where, launched how, which
    Slurm job."""

    probe = "manifest"

    def __init__(self, write: Callable[[], None]) -> None:
        self._write = write
        self.written = False

    def at_attach(self) -> None:
        """The provisional manifest; the first step's write replaces it atomically."""
        if not self.written:
            self._write()

    def on_record(self, record: StepRecord) -> None:
        if not self.written:
            self.written = True
            self._write()

    def close(self) -> None:
        if not self.written:
            self.written = True
            self._write()


def _entry_fields(r: StepRecord) -> dict:
    """Tensor parallel: the block where the NaN entered this rank (``strategies.block_entry``)."""
    return {} if r.entry_block is None else {"entry": r.entry_block, "entry_depth": r.entry_depth}


def _pp_fields(where: dict | None) -> dict:
    """A staged origin (``record.pp_origin``): the stage, micro-batch and site, as event
    fields."""
    if not where:
        return {}
    return {"stage": where["stage"], "microbatch": where["microbatch"], "site": where["site"]}
