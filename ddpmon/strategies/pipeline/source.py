"""Pipeline parallel (``torch.distributed.pipelining``), alone or composed with FSDP2 or DDP.

``attach(model_parts, optimizer, schedule=schedule)``: ``model_parts`` are the stage modules
this rank holds (two for interleaved and V schedules). Why each piece looks the way it does
(docs/parallelism.md, Pipeline parallel; verified facts in the project's pipeline notes):

- A step is one ``schedule.step()`` (wrapped on the instance, undone at close) followed by one
  ``optimizer.step()``. Module hooks fire per micro-batch plus a hidden metadata pass on the
  first step, so none of them marks a step: ddpmon's view of the stages (``PipelineParts``) is
  never called, and the end of ``schedule.step()`` is the end of backward. Gradients are final
  only then (``scale_grads`` and FSDP2's reduce-scatter run in the schedule's last action).
- Names carry the stage (``stage1.layers.0.fc1.weight``): a ``ModuleList`` split renumbers
  layers, so FQNs alone collide across stages.
- Norms: each stage holds only its own parameters, so the global norm is
  ``sqrt(sum over stages of the stage's squared norm)``. Under FSDP2 (and TP) the pp sum is
  folded into the inner source's shard reduction: the pp group is a disjoint span
  (``dtensor_norms.DisjointSpan``), each rank's per-parameter squares a block at its own offset,
  so one all-reduce over the dp x pp world gives every stage's reduced norms at once (HSDP: its
  shard dim, then pp, in sequence). Plain pp and pp+DDP have no shard reduction: one 2-number
  all-reduce over the pp group. Either is issued on every rank at every end of
  ``schedule.step()``, failures included (a failure flag, never a NaN). Group and local norms
  stay per stage.
- NaN origin (decided in ``origin``): a stage is the origin when its weights entering the
  step were finite and the first non-finite thing it touched was something it *produced* (an
  activation it sent, its output, an activation gradient it sent, a parameter gradient), not
  something it *received*.
  Order comes from a host sequence number per probe; on the device each stage keeps only
  ``min(seq)`` of the first bad receipt and the first bad product (no host read). Probes wrap
  the stage's ``forward_one_chunk``/``backward_one_chunk`` (so the metadata pass is not seen)
  and hook each micro-batch's fresh output tensor (never the persistent receive buffers, whose
  hooks would pile up).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from ...host_reads import host_read_free
from ...probes.grads import NormVector, full_pass
from .. import data_check
from ..base import BatchShare, GradientSource, GradSummaries, SourceEnv, StepHost
from ..ddp import CommProbe
from ..dtensor_norms import DisjointSpan, ShardedNorms, disjoint_span, reduction_device
from ..reduction import FlaggedSum, failed_vector
from ..registry import SOURCES, make_source
from ..replicas import ReplicaScope
from ..sharded_source import ShardedSource
from .origin import StageOrigin
from .probes import (
    PP_FLAGS,
    PP_NORM,
    P2PTiming,
    PPStep,
    ScheduleStep,
    StageProbes,
)
from .setup import PipelineSetup

log = logging.getLogger("ddpmon")


# ---------------------------------------------------------------------------------- source
class PipelineSource(GradientSource):
    """Per-stage numbers from the inner strategy (plain, FSDP2, DDP), one all-reduce for the
    global norm (folded into the inner's under FSDP2), and the per-stage origin."""

    name = "pp"
    extra_slots = (PP_NORM, PP_FLAGS)

    def stage_label(self) -> str | None:
        return ",".join(str(int(s.index)) for s in self.setup.stages) or None

    def batch_share(self) -> BatchShare:
        """Every stage of a replica trains on its batch (times the inner TP ranks), read at this
        rank's lowest stage: the batch on the first stage, an earlier stage's activations on
        the others (in the same micro-batches, so the same tokens)."""
        inner = self.inner.batch_share() if self.inner is not None else BatchShare()
        first = self.setup.stages[0]
        over = "the pipeline stages" + (f" x {inner.over}" if inner.ranks > 1 else "")
        return BatchShare(ranks=dist.get_world_size(self.setup.group) * inner.ranks,
                          reads_at=first.module, activations=not first.is_first, over=over)

    def data_check_scope(self) -> tuple[str | None, str]:
        if self.setup.inner in ("ddp", "fsdp2"):
            return "each stage's data-parallel group (the ranks that hold the same stage)", ""
        return None, "pipeline stages without a data-parallel wrapper (DDP, FSDP2)"

    def replica_scope(self) -> tuple[ReplicaScope | None, str]:
        """Each stage's data-parallel replicas: under DDP the ranks of the stages' DDP group
        hold the same stages, bit for bit; under FSDP2/HSDP as the inner source says."""
        if self.inner is not None:
            return self.inner.replica_scope()
        ddp = torch.nn.parallel.DistributedDataParallel
        modules = [i.module for i in self.setup.stages if isinstance(i.module, ddp)]
        if not modules:
            return None, "pipeline stages without a data-parallel wrapper hold no replicas"
        groups = {id(m.process_group): m.process_group for m in modules}
        if len(groups) != 1:
            return None, "the stages' DDP wrappers reduce over different groups"
        position = self.index.position
        params = [p for m in modules for p in m.parameters() if id(p) in position]
        return ReplicaScope(lambda: params, [position[id(p)] for p in params],
                            next(iter(groups.values())),
                            "each stage's data-parallel group (the ranks that hold the same "
                            "stages)"), ""

    def __init__(self, env: SourceEnv, setup: PipelineSetup) -> None:
        super().__init__(env)
        self.setup = setup
        self.name = setup.strategy  # type: ignore[misc]
        self.inner: GradientSource | None = None
        self.probes = StageProbes(setup, env.on_error)
        self.p2p = P2PTiming(setup, self.collectives, env.on_error)
        self._ddp_probes: list[Any] = []
        self._reduced: NormVector | None = None
        self._sum = FlaggedSum(self._reduce_over_stages)
        """The pp sum of this rank's squared norm (unfolded: plain, DDP, or a sharded inner
        source whose own sum does not span the pp group)."""
        self.origin = StageOrigin(self.index)
        """The per-stage origin, decided on the record thread (``PPStep.finish``)."""
        self.has_loss = setup.has_loss
        self._folded = False
        """The inner source's reduction also sums over the pp group (no pp all-reduce here)."""

    # ------------------------------------------------------------------ install / close
    def markers(self, host: StepHost) -> list[Any]:
        """A step is one ``schedule.step()``: its forward and backward."""
        step = ScheduleStep(self.setup, host.steps, host.on_error)
        step.install()
        return [step]

    def install(self) -> None:
        kind = self.setup.inner
        if kind == "ddp":
            for info in self.setup.stages:
                module = info.module
                if not isinstance(module, torch.nn.parallel.DistributedDataParallel):
                    continue
                probe = CommProbe(
                    self.index,
                    # the stage's DDP reduces over the dp group, not the default (world) group
                    inner_hook=allreduce_hook,
                    inner_state=module.process_group,
                    on_error=self.env.on_error,
                    # the duplicate-data check on this rank's first stage module only, over the
                    # stage's dp group (its peers hold the same stages, in the same order)
                    data_check_interval=0 if self._ddp_probes else self.env.data_check_interval,
                    group=module.process_group,
                    local_norm_every=self.env.local_norm_every,
                    grads_are_bucket_views=bool(getattr(module, "gradient_as_bucket_view", False)),
                    collectives=self.collectives,
                )
                try:
                    module.register_comm_hook(None, probe.hook)
                    self._ddp_probes.append(probe)
                except Exception as exc:
                    log.warning("ddpmon: could not register its DDP comm hook on a stage (%s)", exc)
                    self.env.on_error("comm", exc)
        elif kind != "plain" and kind in SOURCES:
            # the inner source's duplicate-data check gathers over its stage's dp group
            self.inner = make_source(kind, replace(self.env, span=self._span()))
            self.inner.collectives = self.collectives  # one recorder: the pipeline takes ours
            self.inner.install()
            norms = self._inner_norms()
            self._folded = norms is not None and norms.plan.span is not None
        self.probes.install()
        self.p2p.install()

    def _reduce_over_stages(self, vector: torch.Tensor) -> Any:
        return dist.all_reduce(vector, op=dist.ReduceOp.SUM, group=self.setup.group,
                               async_op=True)

    def _span(self) -> DisjointSpan | None:
        """This rank's block in the folded vector (one all-gather over the pp group, at attach);
        None, and the unfolded path, if that fails (a broken pp group)."""
        try:
            params = self.index.params
            return disjoint_span(self.setup.group, len(params), reduction_device(params))
        except Exception as exc:
            log.warning("ddpmon: pp sum not folded into the shard reduction (%s)", exc)
            self.env.on_error("grads", exc)
            return None

    def close(self) -> None:
        self.probes.uninstall()
        self.p2p.uninstall()
        try:
            self._sum.wait()
        except Exception:
            pass
        if self.inner is not None:
            self.inner.close()
        super().close()

    # ------------------------------------------------------------------ measurement
    def _inner_norms(self) -> ShardedNorms | None:
        """The sharded inner source's norms (FSDP2, TP), whose sum is folded or followed."""
        return self.inner.norms if isinstance(self.inner, ShardedSource) else None

    def on_backward_end(self) -> None:
        """After ``schedule.step()``: every stage's gradients are final (reduced, scaled). The
        stage's squared norm is measured here and its sum over the pp group started by the
        strategies' one protocol (:mod:`.reduction`: always issued, a failure flagged), waited on
        at ``collect``. Folded, the inner source's own sum already spans the pp group: nothing
        more is issued. Every rank runs the same ``schedule.step()`` calls, so the collectives
        match."""
        if self._folded:
            try:
                self.inner.on_backward_end()  # type: ignore[union-attr]
            except Exception as exc:
                self.env.on_error("grads", exc)
            return
        if self.inner is None:
            measure = self._stage_pass
        else:
            try:
                self.inner.on_backward_end()
                total = self._inner_total()
            except Exception as exc:
                self.env.on_error("grads", exc)
                total = _FAILED
            if total is None:  # nothing of this rank's stages was reduced (a no-sync pass)
                self._sum.take()  # an earlier schedule.step()'s sum is not this step's
                return
            measure = lambda: _checked(total)  # noqa: E731
        failure = self._sum.issue(measure, 1, self._device())
        if failure is not None and not isinstance(failure, _InnerFailed):  # reported above
            self.env.on_error("grads", failure)

    def _stage_pass(self) -> torch.Tensor:
        """One pass over this rank's stages' final gradients: their squared norm."""
        self._reduced = None
        self._reduced = full_pass(self.index, scaled=False)
        return _squares(self._reduced)

    def _inner_total(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(squared norm, failed) of the sharded inner source's sum in flight, waited on (before
        the inner's ``take``), or None when it has none: this rank's stages (unfolded: the pp sum
        follows), or every stage (folded: the vector holds every rank's block)."""
        norms = self._inner_norms()
        issued = norms.in_flight if norms is not None else None
        if issued is None:
            return None
        issued.wait()
        return issued.values.sum().reshape(1), issued.failed

    def collect(self) -> GradSummaries:
        if self.env.defer_reduction_wait:
            later = self._collect_later()
            if later is not None:
                return later
        out = GradSummaries()
        failed = False
        folded: torch.Tensor | None = None
        if self._folded:  # before the inner's take() clears its reduction
            try:
                # None: no schedule.step() end since the last step, on any rank (the folded
                # reduction is a collective): no norm, and nothing to reduce
                total = self._inner_total()
                if total is not None:
                    folded = torch.cat([total[0], total[1].to(torch.float64).reshape(1)])
            except Exception as exc:
                self.env.on_error("grads", exc)
            folded = failed_vector(1, self._device()) if folded is None else folded
        try:
            out = self._collect_inner()
        except Exception as exc:
            failed = True
            self.env.on_error("grads", exc)
        norm = folded
        if norm is None:
            try:
                # Waited on here, as the sharded sources wait on theirs: the step's values must
                # be final when it is delivered (on CPU, flush() delivers every completed step).
                taken = self._sum.take()
                norm = taken.vector if taken is not None else None
            except Exception as exc:  # the collective itself failed: not ours to hide, counted
                self.env.on_error("grads", exc)
                norm = failed_vector(1, self._device())
        if norm is None:  # no schedule.step() end seen since the last step: measure now
            def measured() -> torch.Tensor:
                if failed or out.reduced is None:
                    raise RuntimeError("no stage norms measured this step")
                return _squares(out.reduced)

            self._sum.issue(measured, 1, self._device())
            taken = self._sum.take()
            norm = taken.vector if taken is not None else failed_vector(1, self._device())
        out.extension = self._pp_step(norm)
        return out

    def _collect_later(self) -> GradSummaries | None:
        """``collect`` without waiting on the training thread for the step's sum still in flight
        on the host (gloo; ``SourceEnv.defer_reduction_wait``): the pp norm starts as "failed"
        and is filled when the record thread finishes the collective. None where nothing is in
        flight on the host (the waiting ``collect`` then runs)."""
        issued = self._inner_norms().in_flight if self._folded else self._sum.pending  # type: ignore[union-attr]
        if issued is None or issued.work is None or not host_read_free(issued.vector.device):
            return None
        norm = failed_vector(1, torch.device("cpu"))
        fill = lambda: norm.copy_(issued.total())  # noqa: E731
        deferred = None
        if not self._folded:
            deferred = self._sum.take_later(lambda _: fill(), self.env.on_error)[1]  # type: ignore[index]
        out = GradSummaries()
        try:
            out = self._collect_inner()
        except Exception as exc:
            self.env.on_error("grads", exc)
        if out.deferred is not None:  # folded: the inner's own reduction fills both
            out.deferred.also(fill)
        elif self._folded:  # the inner's take failed or waited: the vector is final now
            issued.wait()
            fill()
        else:
            out.deferred = deferred
        out.extension = self._pp_step(norm)
        return out

    def _pp_step(self, norm: torch.Tensor) -> PPStep:
        """The step's pp facts: its norm vector and the stage probes' flags (taken now)."""
        try:
            flags, table, stages = self.probes.take()
        except Exception as exc:
            self.env.on_error("grads", exc)
            flags, table, stages = torch.zeros(0, dtype=torch.float64), [], []
        return PPStep(self, norm, flags, table, stages)

    def _collect_inner(self) -> GradSummaries:
        setup = self.setup
        unscale = 1.0 / setup.n_microbatches if setup.scale_grads else 1.0
        if self.inner is not None:
            out = self.inner.collect()
            # FSDP2's reduce-scatter input is the sum over micro-batches, before scale_grads
            out.local = _scaled(out.local, unscale)
            return out
        reduced, self._reduced = self._reduced, None
        if reduced is None:
            reduced = full_pass(self.index, scaled=False)
        if setup.inner == "plain":
            return GradSummaries(reduced=reduced, local_is_reduced=True)
        out = GradSummaries(reduced=reduced)
        parts = [p.take() for p in self._ddp_probes]
        local_norms = [n for p in parts for n in p.local_norms]
        if local_norms:
            positions = [i for p in parts for i in p.local_positions]
            # DDP's bucket is the local sum over micro-batches, before scale_grads
            out.local = _scaled(NormVector(torch.cat(local_norms), positions), unscale)
            out.local_complete = all(p.local_buckets == p.buckets for p in parts)
        if parts:  # the first stage module's probe is the one that checks
            out.identical_ranks = data_check.identical_ranks(parts[0].fingerprint,
                                                             self.env.on_error)
        return out

    def _device(self) -> torch.device:
        """Where this rank's pp vector lives: its parameters' device (CPU for a meta one)."""
        for p in self.index.params[:1]:
            return p.device if p.device.type != "meta" else torch.device("cpu")
        return torch.device("cpu")

    def clip_norm(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """The global norm over every stage: this rank's (sharded-aware) norm, squared, summed
        over the pp group; folded and reused from the step's reduction, already summed over
        every stage (no collective). Whether it is reused depends on the same loop on every
        rank, so every rank takes the same path. Every rank must clip (it is a collective), as
        torchtitan does."""
        if self.inner is not None:
            reused = getattr(self.inner, "clip_norms_reused", 0)
            inner = self.inner.clip_norm(params)
            if self._folded and getattr(self.inner, "clip_norms_reused", 0) > reused:
                return inner
        else:
            inner = super().clip_norm(params)
        sq = (inner.to(torch.float64) ** 2).reshape(1)
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=self.setup.group)
        return sq.sqrt().reshape(())

_FAILED = object()
"""The inner source's measurement raised (already reported): this rank contributes a failure."""


class _InnerFailed(RuntimeError):
    """The inner source's measurement failed; it is reported where it happened."""


def _checked(total: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if total is _FAILED:
        raise _InnerFailed("the inner source's measurement failed")
    return total


def _squares(reduced: NormVector | None) -> torch.Tensor:
    """[sum of the squared per-parameter norms] (float64, device)."""
    if reduced is None:
        raise RuntimeError("no stage norms measured")
    wide = reduced.norms.to(torch.float64)
    return (wide * wide).sum().reshape(1)


def _scaled(vector: NormVector | None, factor: float) -> NormVector | None:
    if vector is None or factor == 1.0:
        return vector
    return NormVector(vector.norms * factor, vector.positions, vector.scaled)


__all__ = ["PipelineSource"]
