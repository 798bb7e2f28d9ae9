"""Global gradient norms over sharded (DTensor) gradients without gathering a gradient.

Squared L2 norms add over disjoint pieces, so the global norm of a sharded gradient is the sum of
its shards' squared norms over the mesh dimensions it is *sharded* on. A dimension on which it is
replicated must be counted once. Both rules fit one SUM all-reduce of a per-parameter vector:

- the groups to reduce over are the mesh-dimension groups on which at least one parameter is
  ``Shard``-placed (FSDP2: the shard dim; HSDP: the shard dim only, never replicate; TP: the TP
  dim; FSDP2+TP: both), fixed at attach from the parameters' placements, so every rank issues the
  same collectives;
- on each of those groups, a parameter not sharded on it (``Replicate``, a plain tensor, or a
  parameter on another mesh) contributes only from the group's rank 0 (``mask``): adding exact
  zeros elsewhere keeps the sum exact and counts replicas once;
- a ``Partial`` gradient is reduced first (one all-reduce of that gradient; rare), then treated
  as ``Replicate``.

A *disjoint span* (``DisjointSpan``: the pp group under pipeline parallel, whose ranks hold
different parameters, not replicas) folds a second sum into the same all-reduce: each rank's
per-parameter vector is a block at a fixed offset of one longer vector (zeros elsewhere), no
mask applies along it, and summing over it lays the blocks side by side. The whole vector then
sums to the global squared norm over every stage, with no second collective.

The result is the same on every rank of a reduction span (replicas compute it independently).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._torch_compat import dtensor_local, dtensor_placements, version
from ..host_reads import host_read_free
from ..probes.grads import ParamIndex, per_param_norms
from .base import NormVector
from .reduction import DeferredReduction, FlaggedSum, Issued

try:  # DTensor is public since torch 2.5
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # pragma: no cover - torch without DTensor: nothing is sharded
    DTensor = None  # type: ignore[assignment,misc]
    Replicate = None  # type: ignore[assignment,misc]


def is_dtensor(tensor: object) -> bool:
    return DTensor is not None and isinstance(tensor, DTensor)


def _group_key(group: dist.ProcessGroup) -> str:
    name = getattr(group, "group_name", None)
    return str(name) if name else f"id{id(group)}"


def is_sharded(placement: Any) -> bool:
    """Shard-like: each rank holds a disjoint piece. ``_StridedShard`` (FSDP2 over TP) is not a
    ``Shard`` for ``is_shard()`` in recent torch, so the test is "neither replicated nor
    partial"."""
    return not (placement.is_replicate() or placement.is_partial())


def _shard_groups(param: torch.Tensor) -> list[dist.ProcessGroup]:
    """Process groups of the mesh dimensions on which ``param`` is sharded."""
    if not is_dtensor(param):
        return []
    mesh = param.device_mesh
    return [mesh.get_group(d) for d, pl in enumerate(param.placements) if is_sharded(pl)]


def reduction_device(params: Sequence[torch.Tensor]) -> torch.device:
    """Where the partial-squares vector lives: the mesh's device type (a CPU-offloaded gradient is
    still reduced over the accelerator's process group)."""
    for p in params:
        if is_dtensor(p):
            kind = p.device_mesh.device_type
            if kind == "cpu":
                return torch.device("cpu")
            module = getattr(torch, kind, None)
            index = module.current_device() if module is not None else 0
            return torch.device(kind, index)
    return params[0].device if params else torch.device("cpu")


@dataclass(frozen=True, slots=True)
class DisjointSpan:
    """A group whose ranks hold *different* parameters (pipeline stages): this rank's
    per-parameter block sits at ``offset`` of a ``total``-long vector, the other ranks' blocks
    are zero here, so one SUM over the group lays the blocks side by side."""

    group: dist.ProcessGroup
    offset: int
    total: int


def disjoint_span(group: dist.ProcessGroup, count: int, device: torch.device) -> DisjointSpan:
    """Every rank's parameter count over ``group`` (one all-gather, at attach only): the offset
    of this rank's block is the sum of the lower ranks' counts."""
    mine = torch.tensor([count], dtype=torch.int64, device=device)
    counts = [torch.zeros_like(mine) for _ in range(group.size())]
    dist.all_gather(counts, mine, group=group)
    sizes = [int(c.item()) for c in counts]  # host read at attach, never per step
    rank = dist.get_rank(group)
    return DisjointSpan(group, sum(sizes[:rank]), sum(sizes))


@dataclass(slots=True)
class ReductionPlan:
    """The fixed reduction of one list of parameters (same on every rank)."""

    groups: list[dist.ProcessGroup]
    """Groups to SUM over, in a fixed order (the span's group last)."""
    mask: torch.Tensor
    """float64 per parameter: 1 where this rank contributes the parameter's partial square."""
    device: torch.device
    span: DisjointSpan | None = None
    """Where this rank's block sits in a vector summed over a disjoint span, if any."""

    @property
    def width(self) -> int:
        """Length of the reduced vector, without its failure slot."""
        return self.span.total if self.span is not None else self.mask.numel()

    def own(self, vector: torch.Tensor) -> torch.Tensor:
        """This rank's block of ``vector`` (a view): its own parameters, in index order."""
        start = self.span.offset if self.span is not None else 0
        return vector[start : start + self.mask.numel()]


def build_plan(params: Sequence[torch.Tensor], span: DisjointSpan | None = None) -> ReductionPlan:
    """The groups and the count-once mask for ``params`` (see the module doc); ``span`` adds its
    group to the sum, without a mask (every rank of it contributes its own block)."""
    per_param = [_shard_groups(p) for p in params]
    groups: dict[str, dist.ProcessGroup] = {}
    for shard_groups in per_param:
        for g in shard_groups:
            groups.setdefault(_group_key(g), g)
    first_rank = {key: dist.get_rank(g) == 0 for key, g in groups.items()}
    mask = []
    for shard_groups in per_param:
        own = {_group_key(g) for g in shard_groups}
        mask.append(float(all(key in own or first_rank[key] for key in groups)))
    device = reduction_device(params)
    return ReductionPlan(
        groups=list(groups.values()) + ([span.group] if span is not None else []),
        mask=torch.tensor(mask, dtype=torch.float64, device=device),
        device=device,
        span=span,
    )


def complete_local(grad: torch.Tensor) -> torch.Tensor:
    """The local tensor whose squared norm is this rank's share: ``Partial`` dims reduced first."""
    if not is_dtensor(grad):
        return grad
    placements = grad.placements
    if any(pl.is_partial() for pl in placements):
        fixed = [Replicate() if pl.is_partial() else pl for pl in placements]
        grad = grad.redistribute(grad.device_mesh, fixed)
    return grad.to_local()


def raw_local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's own piece of a gradient, as it holds it (no communication; see
    ``_torch_compat.dtensor_local``)."""
    return dtensor_local(grad) if is_dtensor(grad) else grad


def has_partial(grad: torch.Tensor) -> bool:
    if not is_dtensor(grad):
        return False
    return any(pl.is_partial() for pl in dtensor_placements(grad))


def grads_of(params: Sequence[torch.Tensor]) -> tuple[list[int], list[torch.Tensor]]:
    """(indices into ``params``, gradients) of the parameters that have one; detached only
    where a gradient requires grad (``create_graph``): a DTensor's ``detach`` is a dispatch
    through Python, ~27 us per parameter on CPU, the largest part of the end-of-backward pass
    of a small FSDP2 model otherwise."""
    idx, grads = [], []
    for i, p in enumerate(params):
        g = p.grad
        if g is not None:
            idx.append(i)
            grads.append(g.detach() if g.requires_grad else g)
    return idx, grads


def scatter_squares(
    norms: torch.Tensor, idx: Sequence[int], size: int, device: torch.device
) -> torch.Tensor:
    """float64 vector of length ``size``: ``norms[k]**2`` at ``idx[k]``, zero elsewhere."""
    if len(idx) == size:  # every parameter has a gradient (the usual step): no scatter
        norms = norms.to(device=device, dtype=torch.float64)
        return norms * norms
    out = torch.zeros(size, dtype=torch.float64, device=device)
    if len(idx):
        where = torch.tensor(list(idx), dtype=torch.long, device=device)
        norms = norms.to(device=device, dtype=torch.float64)
        out.index_copy_(0, where, norms * norms)
    return out


def reduce_async(vector: torch.Tensor, plan: ReductionPlan) -> Any:
    """Start the SUM of ``vector`` over the plan's groups in place; returns the work to wait on
    (None without communication). One collective when the groups span the whole world (FSDP2,
    TP, FSDP2+TP on a dp x tp world, FSDP2 folded with pp on a dp x pp world); otherwise one per
    group, the earlier ones waited on (HSDP: its replicate dim is not summed)."""
    groups = plan.groups
    if not groups:
        return None
    if len(groups) > 1 and math.prod(g.size() for g in groups) == dist.get_world_size():
        groups = [None]  # masked sums over orthogonal mesh dims = one sum over the world
    work = None
    for group in groups:
        if work is not None:
            work.wait()
        work = dist.all_reduce(vector, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return work


def all_reduce_sum(vector: torch.Tensor, plan: ReductionPlan) -> torch.Tensor:
    """``reduce_async`` and wait (a stream wait on NCCL, not a host sync)."""
    work = reduce_async(vector, plan)
    if work is not None:
        work.wait()
    return vector


def global_squares(params: Sequence[torch.Tensor], plan: ReductionPlan) -> torch.Tensor:
    """Per-parameter global squared gradient norms of ``params`` (one fused pass over the local
    pieces plus the plan's reduction); a parameter without a gradient counts zero."""
    idx, grads = grads_of(params)
    locals_ = [complete_local(g) for g in grads]
    norms = per_param_norms(locals_) if locals_ else torch.zeros(0, dtype=torch.float64)
    sq = scatter_squares(norms, idx, len(params), plan.device)
    return all_reduce_sum(sq * plan.mask, plan)


class ShardedNorms:
    """The global (reduced) norms of one step: measured and reduced at backward end, waited on
    and handed over at collect.

    The reduction is issued at ``measure`` because backward passes are collective (the same
    count on every rank) while the step pipeline's ``collect`` calls need not be. It follows the
    strategies' one protocol (:mod:`.reduction`): always issued, a failed rank contributes zeros
    and a failure mark, and every rank of the span then reports zeros for that step.
    """

    def __init__(self, index: ParamIndex, span: DisjointSpan | None = None) -> None:
        self.index = index
        self.plan = build_plan(index.params, span)
        self._positions = list(range(len(index)))
        self._sum = FlaggedSum(lambda vector: reduce_async(vector, self.plan))
        self.local_pass: Callable[[list[int], list[torch.Tensor]], torch.Tensor | None] | None
        self.local_pass = None
        """A source's own pass over the raw local pieces (FSDP2: one per unit's shard buffer,
        ``strategies/fsdp/shard_norms.py``); where it answers None, ``per_param_norms``."""

    @property
    def in_flight(self) -> Issued | None:
        """The sum issued at the last ``measure`` and not yet taken (pipeline parallel reads a
        folded one's total; None: no backward reduced since the last take)."""
        return self._sum.pending

    def measure(self, scaled: bool) -> tuple[list[int], torch.Tensor | None]:
        """One fused pass over this rank's pieces of the current gradients, then the async
        reduction. Returns (positions, norms of the raw local pieces) for reuse as a local
        summary; raises after issuing the reduction if the pass failed."""
        n = len(self.index)
        measured: dict[str, Any] = {"idx": [], "norms": None}

        def values() -> torch.Tensor:
            idx, grads = grads_of(self.index.params)
            raw = [raw_local(g) for g in grads]
            norms = self._local_norms(idx, raw) if raw else None
            measured.update(idx=idx, norms=norms)
            complete = norms
            partial = [k for k, g in enumerate(grads) if has_partial(g)]
            if partial and norms is not None:  # rare: reduce those gradients first
                complete = norms.clone()
                fixed = per_param_norms([complete_local(grads[k]) for k in partial])
                complete[torch.tensor(partial, dtype=torch.long)] = fixed.to(complete)
            vec = torch.zeros(self.plan.width, dtype=torch.float64, device=self.plan.device)
            if complete is not None:
                sq = scatter_squares(complete, idx, n, self.plan.device)
                self.plan.own(vec).copy_(sq * self.plan.mask)
            measured["stamp"] = self._current_stamp(idx)
            return vec

        failure = self._sum.issue(values, self.plan.width, self.plan.device,
                                  _Context(scaled, None))
        pending = self._sum.pending
        if pending is not None and failure is None:
            pending.context.stamp = measured["stamp"]
        if failure is not None:
            raise failure
        return measured["idx"], measured["norms"]

    def _local_norms(self, idx: list[int], raw: list[torch.Tensor]) -> torch.Tensor:
        fast = self.local_pass(idx, raw) if self.local_pass is not None else None
        return fast if fast is not None else per_param_norms(raw)

    def _current_stamp(self, idx: Sequence[int]) -> tuple:
        # From the gradients themselves: a DTensor's detach() gets a fresh version counter.
        with torch.no_grad():
            return _stamp(idx, [self.index.params[i].grad for i in idx])

    def wait(self) -> None:
        """Wait on the reduction in flight, if any (a stream wait on NCCL)."""
        self._sum.wait()

    def take(self) -> NormVector | None:
        """The step's reduced norms (device), or None when no backward reduced since the last
        call; the state is then cleared for the next step."""
        taken = self._sum.take()
        if taken is None:
            return None
        return NormVector(self._final(taken), self._positions, taken.context.scaled)

    def take_later(
        self, on_error: Callable[[str, BaseException], None]
    ) -> tuple[NormVector, DeferredReduction | None] | None:
        """``take`` without waiting when the reduction is still in flight on the host (gloo):
        the norms tensor is returned zeroed and a ``DeferredReduction`` that fills it once the
        collective completes, which the record thread finishes. On CPU the wait is the other
        ranks reaching the small all-reduce: work no rank does, kept off the training thread
        as NCCL keeps it off the host. On accelerators this is ``take`` (a stream wait)."""
        pending = self._sum.pending
        if pending is None:
            return None
        if pending.work is None or not host_read_free(pending.vector.device):
            return self.take(), None  # type: ignore[return-value]
        out = torch.zeros(len(self.index), dtype=torch.float64)
        taken = self._sum.take_later(lambda issued: out.copy_(self._final(issued)), on_error)
        deferred = taken[1] if taken is not None else None
        return NormVector(out, self._positions, pending.context.scaled), deferred

    def _final(self, issued: Issued) -> torch.Tensor:
        """This rank's per-parameter norms from the reduced squares (its own block under a
        disjoint span); zeros when some rank failed."""
        return issued.or_zeros(self.plan.own(issued.values).sqrt())

    def reuse_for_clip(
        self, params: Sequence[torch.Tensor], scaled_now: bool, scale: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The global norm of ``params`` from this step's reduction, without another pass, or
        None; with a disjoint span, the norm over every rank's block (every stage). Once per
        measurement, and only when ``params`` are exactly the measured ones and no gradient
        changed since: the version counters catch ordinary in-place ops, and a GradScaler
        ``unscale_`` in between is divided out (``scale``). ``_foreach_*`` in-place ops on
        DTensor bump no counter (torch.nn.utils.clip_grad_norm_), hence once only.

        Every rank must decide alike (the fallback is a collective). A rank whose measurement
        failed has no stamp, and the reduction carries its failure flag to every rank: on the
        host (gloo) the flag is read for free and every rank falls back; on a device, where
        reading it would sync, the failed rank reuses too and every rank gets 0 (no clipping
        that step, the failure counted) rather than mismatched collectives."""
        pending = self._sum.pending
        if pending is None or pending.context.reused:
            return None
        if pending.context.stamp is None:
            return self._reuse_failed(pending)
        if scaled_now and not pending.context.scaled:
            return None
        positions = self.index.positions_of(params)
        if positions is None:
            return None
        idx = sorted(i for i, p in zip(positions, params, strict=True) if p.grad is not None)
        if self._current_stamp(idx) != pending.context.stamp:
            return None
        if pending.context.scaled and not scaled_now:
            if scale is None:
                return None
            unscale = 1.0 / scale.to(device=pending.vector.device, dtype=torch.float64)
        else:
            unscale = None
        pending.wait()
        pending.context.reused = True
        # every rank falls back alike
        if host_read_free(pending.vector.device) and bool(pending.failed):
            return None
        total = pending.values.sum().sqrt()
        if unscale is not None:
            total = total * unscale
        return pending.or_zeros(total)

    def _reuse_failed(self, pending: Issued) -> torch.Tensor | None:
        """``reuse_for_clip`` on the rank whose measurement failed (see there)."""
        pending.wait()
        pending.context.reused = True
        vec = pending.vector
        if host_read_free(vec.device):
            return None
        return torch.zeros((), dtype=vec.dtype, device=vec.device)


@dataclass(slots=True)
class _Context:
    """What a ``ShardedNorms`` sum carries beside its vector."""

    scaled: bool
    stamp: tuple | None
    """``_stamp`` of the gradients at measurement (None: the measurement failed)."""
    reused: bool = False


def _stamp(idx: Sequence[int], grads: Sequence[torch.Tensor]) -> tuple:
    """Host-side identity of gradient contents: the local memory and the version counters of
    the gradient and of its local piece (an in-place op on a DTensor bumps the wrapper's, one on
    ``to_local()`` the piece's). Reading them is metadata, not a device sync."""
    pieces = [(g, raw_local(g)) for g in grads]
    return tuple(idx), tuple((t.data_ptr(), version(t), version(g)) for g, t in pieces)
