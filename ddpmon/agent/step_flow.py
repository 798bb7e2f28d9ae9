"""The step flow: step boundaries -> gradient norms -> step values -> readback -> step record.

Hot path (training thread, per optimizer step): ask the gradient source for its device norms and
queue them, with the loss and scaler tensors, for lazy readback (``Readback.push``: on CPU the
tensors are queued as they are; on CUDA packed into one vector and copied asynchronously).
Nothing here reads a device value, except the ``skip``/``raise`` policies (one flag, documented).
Everything derived (the record: global and group norms, origin, mismatch; then the sinks: metric
state, events, progress, history) happens when the values are drained (``drain``), on the
agent's record thread (``drainer.RecordThread``) when one runs, else right after each step.

What counts as a step (docs/concepts.md, The step): one optimizer step, whoever decides it:
- ``optimizer.step()`` (post-hook), or ``scaler.update()`` when a GradScaler is given (so a step
  the scaler skips is still a step);
- ``optimizer.step(closure)``: the closure's backward runs inside ``step``, so its gradients are
  collected after it, at the post-hook;
- a step the user's loop skips (``if finite: opt.step()``): detected when the next forward
  starts and the gradients of the last backward were dropped (``zero_grad``) without a step;
- gradient-accumulation micro-steps are not steps: their gradients are kept, not dropped;
- an *inert* step is not a step: ``optimizer.step()`` with no forward and no backward since the
  last step, at lr 0 in every parameter group. It cannot change a weight; it is how torch's
  ``_init_optim_state`` creates optimizer state inside checkpoint loaders (DCP's
  ``set_optimizer_state_dict``, the sharded examples' loader), so attaching before or after such a
  load numbers the steps alike (:func:`is_inert_step`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..host_reads import host_read_free
from ..metrics import step_slots as slot
from ..metrics.state import StepRecord
from ..metrics.step_fields import COMPUTED
from ..metrics.step_metrics import PerStepMetric, StepInputs, evaluate
from ..probes.grads import ParamIndex, host_finite
from ..recorder.live_step import AFTER_BACKWARD, DATA, FORWARD, NO_LIVE, OPTIMIZER
from ..strategies.base import GradientSource, GradSummaries
from ..strategies.precision import Precision, saw_forward
from .guard import Guard
from .observed import plain
from .policy import NonFinitePolicy, OriginTracker
from .readback import Arrived, Readback
from .records import StepMeta, build_record
from .rerun import decide_recorded, wrap_closure
from .step_detection import GradSentinel, is_inert_step
from .step_phase import StepPhase
from .step_split import StepSplit
from .step_vector import STEP_SLOTS, StepVectorLayout
from .trainer_norms import TrainerNorms
from .unmeasured import UnmeasuredSteps


class StepFlow(StepPhase):
    def __init__(
        self,
        *,
        source: GradientSource,
        index: ParamIndex,
        guard: Guard,
        policy: NonFinitePolicy,
        sinks: Sequence[Any],
        grad_norm_tolerance: float = 1e-3,
        layout: StepVectorLayout | None = None,
        readback: Readback | None = None,
        optimizer: Any = None,
        step_metrics: Sequence[PerStepMetric] = (),
        precision: Precision | None = None,
    ) -> None:
        self.source = source
        self.index = index
        self.guard = guard
        self.policy = policy
        self.sinks = list(sinks)
        self.optimizer = optimizer
        self.step_metrics = tuple(step_metrics)
        self.replicas: Any = None  # strategies.replicas.ReplicaCheck, where there are replicas
        self._replica_inflight: Any = None  # a check issued at this step's first forward
        self._forward_seen = False
        self.rerun: Any = None  # agent.rerun.StepRerun under on_nonfinite='rerun'
        self.probes: Any = None  # agent.update_wiring.SpikeParts: update squares, max logits
        self.layout = layout or StepVectorLayout(
            (*STEP_SLOTS, *source.extra_slots, *(m.slot for m in self.step_metrics),
             *(f.slot for f in COMPUTED))
        )
        self.readback = readback or Readback(self.layout)
        self.readback.on_unreadable = self._unreadable
        self.background = False
        """True while a record thread drains; the hot path then only queues."""
        self._records_lock = threading.RLock()
        """Held while records are derived and handed to the sinks (one drainer at a time)."""
        self.tracker = OriginTracker()
        self.step = 0  # index of the step in progress (host counter)
        self.batch_shapes: list | None = None
        self.split = StepSplit(getattr(source, "collectives", None), index.params)
        self._step_start, self._last_end, self.attached = None, None, time.perf_counter()
        self._loss: Any = None
        self._backward_pending = False
        self._sentinel: GradSentinel | None = None
        self._collected: GradSummaries | None = None
        self._closure_step = False
        self._policy_skipped = False
        self._inert = False
        self.inert_steps = 0
        """Optimizer steps not counted as training steps (:func:`is_inert_step`)."""
        self.phase = self._outside_checkpoint = DATA
        """The phase of the step in progress (``live_step``'s codes)."""
        self.live: Any = NO_LIVE
        """Where the step in progress is kept for a fatal signal's dump (``LiveStep``)."""
        self.precision = precision
        """Noted at the first forward (the autocast it runs under)."""
        self.entry: Any = None  # strategies.block_entry.BlockEntry (TP): where a NaN entered
        self.unmeasured = UnmeasuredSteps(guard, index.params, getattr(source, "name", "?"))
        self.trainer_norms = TrainerNorms(
            grad_norm_tolerance, lambda: self.sinks, guard, self._records_lock
        )

    def heartbeat(self) -> float:
        """The stall watchdog's heartbeat, perf_counter seconds: the last step's end or attach."""
        return self._last_end if self._last_end is not None else self.attached

    def resume_at(self, step: int) -> bool:
        """Count steps from ``step`` (a resume from a checkpoint) if none has started yet."""
        if self.step != 0 or self._backward_pending:
            return False
        self.step = step
        self._at(DATA)
        return True

    # ------------------------------------------------------------------ user-facing inputs
    def observe_loss(self, loss: Any) -> None:
        with self.guard("loss"):
            self._loss = None  # one that cannot be read is dropped (counted), not the last one
            self._loss = plain(loss, shares=True) if isinstance(loss, torch.Tensor) else float(loss)

    @property
    def backward_pending(self) -> bool:
        """A backward ran since the last optimizer step (gradients are accumulating)."""
        return self._backward_pending

    def observe_samples(self, ids: Any) -> None:
        """The step's sample ids, kept by reference and read only if the step is rerun."""
        if self.rerun is not None:
            self.rerun.samples = ids

    def observe_grad_norm(self, value: Any, step: int | None = None) -> None:
        """A trainer's own grad norm for ``step`` (default: the step in progress)."""
        with self.guard("loss"):
            self.trainer_norms.observe(value, self.step if step is None else int(step), self.step)

    # ------------------------------------------------------------------ boundaries (hooks)
    def forward_started(self, args: tuple) -> None:
        if self.rerun is not None and self.rerun.rerunning:  # the same step, run again
            with self.guard("step"):
                self.rerun.saw_batch(args)
            return
        if (
            self._backward_pending
            and not getattr(self.source, "decides_steps", False)
            and self._sentinel is not None
            and self._sentinel.dropped()
        ):
            self.complete(skipped_by="loop")
        if self._step_start is None:
            self._step_start = time.perf_counter()
        if not self._forward_seen:
            self._forward_seen = True
            if self.replicas is not None and self.replicas.scope.at_forward:
                self._replica_inflight = self._launch_replicas()
        self._at(FORWARD)
        self.split.forward_started()
        if self.batch_shapes is None:
            if self.precision is not None:
                with self.guard("step"):
                    saw_forward(self.precision)
            with self.guard("data"):
                self.batch_shapes = [
                    list(a.shape) for a in args if isinstance(a, torch.Tensor)
                ] or [type(a).__name__ for a in args]

    def backward_ended(self) -> None:
        with self.guard("grads"):
            self.source.on_backward_end()
        self._backward_pending = True
        self._sentinel = GradSentinel.take(self.index.params)
        self._at(AFTER_BACKWARD)
        self.split.backward_ended()

    def batch_started(self) -> None:
        """A trainer says a training batch began (Lightning, the HF Trainer): the step is
        timed from here, and an optimizer step after it is never inert."""
        if self._step_start is None:
            self._step_start = time.perf_counter()

    def optimizer_pre(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """``args`` as torch passes them to step pre-hooks: ``(optimizer, *step_args)``.
        Returns new ``(args, kwargs)`` when the closure is to be replaced (``rerun``)."""
        closure = kwargs.get("closure") if kwargs else None
        if closure is None and not self._backward_pending and self._step_start is None:
            with self.guard("step"):
                self._inert = is_inert_step(args[0] if args else None)
            if self._inert:
                return
        self._at(OPTIMIZER)
        self.split.optimizer_started()
        if closure is not None or (len(args) > 1 and any(callable(a) for a in args[1:])):
            self._closure_step = True  # its backward has not run yet: collect after the step
            return self._wrap_closure(args, kwargs) if self.rerun is not None else None
        self._collect()
        if self.rerun is not None:
            if decide_recorded(self):  # the step was in hand (run_step, a trainer): decided
                return None
            self.rerun.no_closure()
        if self.policy.reads:
            self._policy_skipped = self.policy.before_step(
                self._collected.reduced, self.step, skip_allowed=True,
                extra=self._collected.extension,
            )
        return None

    def _wrap_closure(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        # gradients accumulated before the closure (micro-steps outside it) cannot be replayed
        replayable = not self._backward_pending
        with self.guard("step"):
            if kwargs and kwargs.get("closure") is not None:
                closure = wrap_closure(self, kwargs["closure"], replayable)
                return args, {**kwargs, "closure": closure}
            at = next(i for i in range(1, len(args)) if callable(args[i]))
            closure = wrap_closure(self, args[at], replayable)
            return (*args[:at], closure, *args[at + 1:]), kwargs
        return None

    # ------------------------------------------------------------------ for agent.rerun
    def collect_now(self) -> GradSummaries:
        """The step's gradient results so far (collected once per backward pass)."""
        return self._collect()

    def recollect(self) -> None:
        """The step's backward runs again: collect its results afresh."""
        self._collected, self._backward_pending = None, False

    def drop_grads(self) -> None:
        for p in self.index.params:
            p.grad = None

    def skipped_by_policy(self) -> None:
        self._policy_skipped = True

    def optimizer_post(self) -> None:
        if self._inert:
            self._inert = False
            self.inert_steps += 1
            return
        self.complete(skipped_by="policy" if self._policy_skipped else None)

    def scaler_updated(self, found: Any, scale_before: Any, scale_after: Any) -> None:
        self.complete(found=found, grad_scale=scale_before, scale_after=scale_after)

    # ------------------------------------------------------------------ the step itself
    def complete(
        self,
        *,
        skipped_by: str | None = None,
        found: Any = None,
        grad_scale: Any = None,
        scale_after: Any = None,
        host_skipped: bool | None = None,
        host_scale_after: float | None = None,
    ) -> None:
        """Close the step in progress: queue its device values for readback. ``host_*``: facts
        an engine that decides its own steps keeps on the host."""
        urgent = False
        try:
            with self.guard("step"):
                summaries = self._collect()
                decided = self.rerun is not None and self._closure_step
                if self.policy.reads and not decided and (self._closure_step or found is not None):
                    # closure or scaler steps: the update already happened; raise still can
                    self.policy.before_step(
                        summaries.reduced, self.step, skip_allowed=False,
                        extra=summaries.extension,
                    )
                urgent = self._package(
                    summaries, skipped_by, found, grad_scale, scale_after,
                    host=(host_skipped, host_scale_after), replica_check=self._check_replicas(),
                )
        finally:
            self.step += 1
            self._step_start = None
            self._last_end = time.perf_counter()
            self._loss = None
            self._collected, self._sentinel = None, None
            self._closure_step = self._policy_skipped = False
            self._backward_pending = self._forward_seen = False
            self.split.reset()  # a step that failed before its split finished: the next starts anew
            if self.rerun is not None:
                self.rerun.end_step()
            self._at(DATA)
        if not self.background or urgent or self.readback.full:
            self.drain(wait=False)

    def _collect(self) -> GradSummaries:
        if self._collected is None:
            self._collected = GradSummaries()
            with self.guard("grads"):
                self.index.order.settle()  # after the first backward: one attribute check
                if not self._backward_pending:
                    # No end of backward seen: the loop does not call the model's forward
                    # (Lightning's training_step, model.loss(...)). Measure the gradients as
                    # they are now; clipping in between cannot be seen then.
                    self.source.on_backward_end()
                self._collected = self.source.collect()
                self.unmeasured.check(self._collected, self.step)
            recorder = getattr(self.source, "collectives", None)
            with self.guard("comm"):
                taken = recorder.take() if recorder is not None else None
                if taken is not None:
                    self._collected.comm = taken
        return self._collected

    def _check_replicas(self) -> Any:
        """Start the replica checksums' gather on a check step (after the update: every rank
        closes the step here, whoever decided it); or hand over the one this step's first
        forward started (``at_forward``)."""
        inflight, self._replica_inflight = self._replica_inflight, None
        if self.replicas is None or self.replicas.scope.at_forward:
            return inflight
        return self._launch_replicas()

    def _launch_replicas(self) -> Any:
        if not self.replicas.due(self.step):
            return None
        with self.guard("comm"):
            return self.replicas.launch(self.step)
        return None

    def _package(
        self, s: GradSummaries, skipped_by, found, grad_scale, scale_after, host=(None, None),
        replica_check: Any = None,
    ) -> bool:
        """Queue the step's tensors and host facts; True when its gradients are known (host
        memory) to be non-finite, so the caller drains now and the evidence holds them."""
        end_perf, end_wall = time.perf_counter(), time.time()
        start = self._step_start if self._step_start is not None else self._last_end
        known = self._step_start is not None and self._last_end is not None
        data_wait = max(0.0, self._step_start - self._last_end) if known else None
        loss, loss_host = self._loss, None
        if not isinstance(loss, torch.Tensor):
            loss, loss_host = None, loss
        elif loss.numel() != 1:
            loss = loss.reshape(-1)[:1]
        trainer, trainer_host, trainer_step = self.trainer_norms.take_queued()
        reduced = s.reduced.norms if s.reduced is not None else None
        local = s.local.norms if s.local is not None else None
        values = {
            slot.REDUCED_NORMS: reduced,
            slot.LOCAL_NORMS: local,
            slot.LOSS: loss,
            slot.GRAD_SCALE: grad_scale,
            slot.LOSS_SCALE: scale_after,
            slot.FOUND_INF: found,
            slot.IDENTICAL_RANKS: s.identical_ranks,
            slot.TRAINER_NORM: trainer,
            **(self.probes.take(self.guard) if self.probes is not None else {}),
            slot.ENTRY_BLOCKS: self.guard.taken("entry", self.entry),  # fails alone, counted
        }
        if s.extension is not None:
            values.update(s.extension.values())
        inputs = StepInputs(self.step, self.optimizer, self._loss, s)
        queued, on_host = (None, None) if not self.step_metrics else evaluate(
            self.step_metrics, inputs, self.guard, values,
        )
        fields = evaluate(COMPUTED, inputs, self.guard, values, key=None) if COMPUTED else None
        meta = StepMeta(
            step=self.step,
            wall_time=end_wall,
            duration=(duration := end_perf - start if start is not None else None),
            data_wait=data_wait, phases=self.split.finish(duration, data_wait),
            summaries=s,
            loss_host=loss_host,
            trainer_norm_host=trainer_host,
            trainer_norm_step=trainer_step,
            skipped_by=skipped_by, host_skipped=host[0], host_scale_after=host[1],
            step_metrics=queued,
            step_values_host=on_host,
            fields=fields,
            replica_check=replica_check,
            extras=self.probes,
        )
        self.readback.push(values, meta, s.deferred)
        if s.deferred is not None:  # not reduced yet: only the local norms can say now
            reduced = None
        return self.background and (_host_nonfinite(reduced) or _host_nonfinite(local))

    # ------------------------------------------------------------------ readback side
    def drain(self, wait: bool, collectives: bool = False) -> None:
        """Turn every step whose values are on the host into a record and hand it to the
        sinks, oldest first (``collectives``: also waiting for host-side norm reductions still
        in flight). Any thread; one at a time. Never raises."""
        with self._records_lock, self.guard("readback"):
            arrived = self.readback.poll(wait=wait, collectives=collectives)
            for entry in arrived:
                self._deliver(entry)
            if arrived:
                for sink in self.sinks:
                    batch_end = getattr(sink, "on_batch_end", None)
                    if batch_end is not None:
                        with self.guard(sink.probe):
                            batch_end()

    def _deliver(self, entry: Arrived) -> None:
        with self.guard("readback"):
            record = self._record(entry.parts(), entry.meta, entry.reduction_failed)
            if not record.origin_decided:
                self.tracker.classify(record)
            for sink in self.sinks:
                with self.guard(sink.probe):
                    sink.on_record(record)

    def _unreadable(self, name: str, exc: Exception) -> None:
        """A step value that cannot be read back: left out alone, counted under the probe that
        observed it (the loss and a trainer's norm: ``loss``; a per-step metric: ``step``)."""
        if name in (slot.LOSS, slot.TRAINER_NORM):
            probe = "loss"
        elif any(m.slot.name == name for m in self.step_metrics):
            probe = "step"
        else:
            probe = "readback"
        self.guard.error(probe, exc)

    def _record(
        self, parts: dict[str, list[float]], meta: StepMeta, reduction_failed: bool = False
    ) -> StepRecord:
        record = build_record(parts, meta, self.index, self.guard, reduction_failed)
        theirs = (
            parts[slot.TRAINER_NORM][0] if slot.TRAINER_NORM in parts else meta.trainer_norm_host
        )
        self.trainer_norms.with_record(record, theirs, meta.trainer_norm_step)
        if self.entry is not None:
            self.entry.mark(record, parts.get(slot.ENTRY_BLOCKS))
        return record


def _host_nonfinite(norms: torch.Tensor | None) -> bool:
    """Non-finite per-parameter norms that are already in host memory (no device read)."""
    return norms is not None and host_read_free(norms.device) and not host_finite(norms)
