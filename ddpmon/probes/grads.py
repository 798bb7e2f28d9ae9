"""Gradient norms and non-finite detection: one fused pass on the device, the rest on the host.

Per-parameter L2 norms come from ``torch._foreach_norm`` (one read of every gradient): that small
vector is all the device computes. Everything else (global norm, per-group norms, the first
non-finite parameter and its kind, unscaling) is derived from it on the host after the lazy
readback (:func:`summarize_host`, numpy), so the hot path launches two kernels, not a dozen.

Exactness, on a GPU: the norms accumulate in float64 (memory-bound either way, so free), which
is exact to the reference and cannot overflow for fp32/fp16/bf16 gradients.

Exactness, on CPU: a float64 reduction of a long tensor costs ~16x a float32 one there, and a
float32 running sum over a whole tensor drifts low (measured: -2e-6 relative over 1e5 values,
-2e-5 over 8e6, and a BERT's global norm 5e-6 low). So a long tensor is reduced in rows of
:data:`CHUNK` elements in float32 and the rows' squares are added in float64 (one read of every
gradient, within the float32 rounding of each row's result); a small one (:data:`SMALL_NUMEL`)
in float64, which costs little in cache. A float32 norm overflows to inf for finite values above
~1e19, which would look like an Inf gradient: an inf norm is re-measured in float64 for that
tensor only (CPU tensors can be read without any device sync: this rare path is exact, cheap).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .._torch_compat import compiled_inner, foreach_norm
from ..host_reads import host_read_free, sync_audit
from .backward_order import BackwardOrder
from .stacked import StackBuffers, stacked_norms


@dataclass(slots=True)
class NormVector:
    """Per-parameter L2 norms of one set of gradients, still on the device."""

    norms: torch.Tensor
    """1-D float tensor, one L2 norm per entry of ``positions`` (NaN/Inf where the gradient holds
    them); for sharded gradients the norm of the *full* parameter gradient (partial squares
    already reduced over the mesh)."""
    positions: Sequence[int]
    """``ParamIndex`` positions (registration order of ``model.named_parameters()``, i.e. the
    original FQNs) of each entry, in the order of ``norms``."""
    scaled: bool = True
    """True when the gradients were measured as the GradScaler left them after backward (still
    multiplied by the loss scale); the pipeline divides by the scale it recorded. False for
    gradients already unscaled (e.g. measured by ``ddpmon.clip_grad_norm_`` after ``unscale_``).
    Without a GradScaler the flag is ignored."""


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module under DDP (``.module``) and ``torch.compile`` (``._orig_mod``)
    wrappers, so parameter names are the ones the user wrote."""
    seen = 0
    while seen < 8:
        inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            inner = compiled_inner(model)
        if not isinstance(inner, torch.nn.Module):
            return model
        model, seen = inner, seen + 1
    return model


class ParamIndex:
    """Stable indices, names and bounded groups of a model's trainable parameters."""

    def __init__(self, model: torch.nn.Module, group_depth: int = 1, max_groups: int = 32) -> None:
        named = [(n, p) for n, p in unwrap_model(model).named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.names = [n for n, _ in named]
        self.position = {id(p): i for i, p in enumerate(self.params)}
        self.all_positions: tuple[int, ...] = tuple(range(len(self.params)))
        self.stack_plan = StackPlan.for_shapes([p.shape for p in self.params])
        self.group_names, self.group_of = _groups(self.names, group_depth, max_groups)
        self.group_array = np.asarray(self.group_of, dtype=np.int64)
        """``group_of`` as a numpy index (group sums on the host)."""
        self.order = BackwardOrder(len(self.params))
        """Backward order of the positions: which non-finite gradient is the origin."""

    def __len__(self) -> int:
        return len(self.params)

    @property
    def n_groups(self) -> int:
        return len(self.group_names)

    def name(self, position: int) -> str:
        return self.names[position] if 0 <= position < len(self.names) else "unknown"

    def grad_of(self, name: str) -> torch.Tensor | None:
        """The current gradient of the parameter called ``name`` (None: no such parameter, or
        no gradient)."""
        if name in self.names:
            return self.params[self.names.index(name)].grad
        return None

    def positions_of(self, params: Sequence[torch.Tensor]) -> list[int] | None:
        """Positions of ``params``, or None if any of them is not this model's."""
        try:
            return [self.position[id(p)] for p in params]
        except KeyError:
            return None


def _groups(names: list[str], depth: int, max_groups: int) -> tuple[list[str], list[int]]:
    raw = [".".join(n.split(".")[:depth]) if depth > 0 else "all" for n in names]
    # A parameter directly on the root module (e.g. "bias" at depth 1) is its own group name.
    order: list[str] = []
    for g in raw:
        if g not in order:
            order.append(g)
    if len(order) > max_groups:
        kept = order[: max_groups - 1]
        order = [*kept, "other"]
        raw = [g if g in kept else "other" for g in raw]
    index = {g: i for i, g in enumerate(order)}
    return order, [index[g] for g in raw]


def per_param_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """float64 vector of L2 norms, one per tensor, computed in one fused pass (see module doc;
    on CPU small tensors in float64, long ones in float32 rows whose squares add in float64,
    overflowed entries re-checked)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    if not host_read_free(tensors[0].device):
        return torch.stack(_foreach_norm_grouped(tensors, torch.float64))
    kinds: dict[str, list[int]] = {"exact": [], "rows": [], "whole": []}
    for i, t in enumerate(tensors):
        kinds[_cpu_kind(t)].append(i)
    if len(kinds["rows"]) == len(tensors):  # the common case for large models
        return _widen_checked(_row_norms(tensors), tensors)
    norms = torch.empty(len(tensors), dtype=torch.float64)
    for kind, idx in kinds.items():
        if idx:
            part = [tensors[i] for i in idx]
            norms[_as_slice(idx)] = _CPU_NORMS[kind](part).to(torch.float64)
    return _widen_checked(norms, tensors)


def _as_slice(idx: list[int]) -> slice | list[int]:
    """Evenly spaced positions (interleaved weights, biases) as a slice: no index tensor."""
    step = idx[1] - idx[0] if len(idx) > 1 else 1
    even = step > 0 and all(b - a == step for a, b in zip(idx, idx[1:], strict=False))
    return slice(idx[0], idx[-1] + 1, step) if even else idx


_WIDE = (torch.float32, torch.float64)

CHUNK = 256
"""Elements per float32 row on CPU. Rows this short stay within the float32 rounding of their
result (a tensor's norm from its rows: worst 6e-8 relative measured from 16,384 values up),
where one long float32 reduction drifts (2e-6 over 1e5 values, 2e-5 over 8e6). On one thread
a row pass costs 1.05-1.9x one long reduction; on two it parallelises and wins."""

SMALL_NUMEL = 8192
"""Up to this many elements (and more than one row), a CPU tensor's norm accumulates in float64:
its float32 rows would be too few to average their rounding (worst 2e-7 measured at 1,024
values), and in cache float64 costs little. Same-shaped small gradients are instead stacked and
reduced in one float32 call (per-call dispatch dominates there; see :func:`_stacked_norms`):
16 tensors of an 8 x Linear(64) MLP take half the time of ``_foreach_norm``."""


def _cpu_kind(t: torch.Tensor) -> str:
    """How a CPU tensor's norm is taken: ``whole`` (one reduction: at most one row long, a
    DTensor, or a strided 1-D view that rows would copy), ``exact`` (float64, other small plain
    tensors) or ``rows`` (float32 rows, when they are views: dense in some order of its
    dimensions, or strided with two or more, rows along the last one)."""
    numel = t.numel() if type(t) is torch.Tensor else 0
    if numel <= CHUNK:
        return "whole"  # one row: within its float32 rounding (measured 8e-8 at 256)
    if numel <= SMALL_NUMEL:
        return "exact"
    return "rows" if t.dim() > 1 or t.is_contiguous() else "whole"


def _exact_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack(_foreach_norm_grouped(tensors, torch.float64))


def _dense(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as a contiguous view with its dimensions reordered (a norm does not care about
    their order), or None if no order makes it contiguous."""
    if t.is_contiguous():
        return t
    view = t.permute(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    return view if view.is_contiguous() else None


def _whole_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One float32 (or float64) reduction per tensor, for those a row view would copy."""
    if _uniform_cpu(tensors):
        return torch.stack(_foreach_norm(list(tensors), None))  # one call
    wide = all(t.dtype in _WIDE for t in tensors)
    return torch.stack(_foreach_norm_grouped(tensors, None if wide else torch.float32))


def _row_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """float64 norms of ``rows`` tensors (:func:`_cpu_kind`): float32 norms of rows (one call
    per tensor), their squares summed per tensor in float64, plus the squares of the tails."""
    rows: list[torch.Tensor] = []
    tails: list[torch.Tensor] = []
    tail_of: list[int] = []
    starts: list[int] = []
    at = 0
    for i, t in enumerate(tensors):
        row, tail = _rows_of(t)
        rows.append(row)
        if tail is not None and tail.numel():
            tails.append(tail)
            tail_of.append(i)
        starts.append(at)
        at += row.numel()
    if any(r.dtype is not rows[0].dtype for r in rows):
        rows = [r.double() for r in rows]
    squares = torch.cat(rows).double().square_().numpy()
    sums = np.add.reduceat(squares, starts)
    if tails:
        tail = torch.stack(_foreach_norm_grouped(tails, torch.float32)).numpy()
        sums[tail_of] += tail * tail
    return torch.from_numpy(np.sqrt(sums))


def _rows_of(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The row norms of one tensor (views only, flattened) and its tail of fewer than
    ``CHUNK`` elements (None for a strided tensor, whose rows cover it)."""
    dense = _dense(t)
    if dense is not None:
        flat = dense.view(-1)
        body = flat.numel() - flat.numel() % CHUNK
        return _norm_rows(flat[:body].view(-1, CHUNK), t), flat[body:]
    last = t.shape[-1]
    if last > CHUNK and last % CHUNK == 0 and t.stride(-1) == 1:
        return _norm_rows(t.unflatten(-1, (-1, CHUNK)), t).reshape(-1), None
    return _norm_rows(t, t).reshape(-1), None


def _norm_rows(rows: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(rows, dim=-1, dtype=_acc(source))


def _acc(t: torch.Tensor) -> torch.dtype | None:
    """Accumulate half-precision gradients in float32; float32/float64 in their own."""
    return None if t.dtype in _WIDE else torch.float32


_CPU_NORMS = {"exact": _exact_norms, "rows": _row_norms, "whole": _whole_norms}


@dataclass(frozen=True, slots=True)
class StackPlan:
    """How to take the norms of a model's dense CPU gradients in few calls: tensors of one small
    shape are stacked and reduced together, the rest go through ``_foreach_norm``. Built once
    from the parameter shapes (a gradient has its parameter's shape)."""

    stacks: tuple[tuple[int, ...], ...]
    rest: tuple[int, ...]
    order: tuple[int, ...]
    """Tensor index of each entry of the result."""
    buffers: StackBuffers = field(compare=False, repr=False)
    """The stacks' reusable buffers (``probes.stacked``)."""

    @classmethod
    def for_shapes(cls, shapes: Sequence[Sequence[int]]) -> StackPlan | None:
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, shape in enumerate(shapes):
            if math.prod(shape) <= SMALL_NUMEL:
                groups.setdefault(tuple(shape), []).append(i)
        stacks = tuple(tuple(g) for g in groups.values() if len(g) > 1)
        if not stacks:
            return None
        stacked = {i for g in stacks for i in g}
        rest = tuple(i for i in range(len(shapes)) if i not in stacked)
        order = tuple(i for g in stacks for i in g) + rest
        return cls(stacks, rest, order, StackBuffers(stacks))

    def norms(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """float64 norms in ``order`` (same checks and rows as ``per_param_norms``) of plain
        CPU tensors of one float32/float64 dtype (``_uniform_cpu``)."""
        wide = self.buffers.norms(tensors)
        if wide is not None:
            if not self.rest:
                return _widen_checked(wide, tensors, self.order)
            parts = [wide, per_param_norms([tensors[i] for i in self.rest])]
            return _widen_checked(torch.cat(parts), tensors, self.order)
        parts = [stacked_norms([tensors[i] for i in group]) for group in self.stacks]
        if self.rest:
            parts.append(per_param_norms([tensors[i] for i in self.rest]))
        return _widen_checked(torch.cat(parts), tensors, self.order)


def _uniform_cpu(tensors: Sequence[torch.Tensor]) -> bool:
    """Plain CPU tensors of one float32/float64 dtype (no subclass such as DTensor)."""
    dtype = getattr(tensors[0], "dtype", None)  # None: no gradient
    if dtype not in _WIDE:
        return False
    for t in tensors:  # a loop, not all(...): no generator frame per tensor (hot path)
        if type(t) is not torch.Tensor or t.dtype is not dtype or not t.is_cpu or t.is_sparse:
            return False
    return True


def _widen_checked(
    norms: torch.Tensor, tensors: Sequence[torch.Tensor], order: Sequence[int] | None = None
) -> torch.Tensor:
    """CPU norms to float64, with float32 overflows (inf) re-measured in float64."""
    # Always float64 out: the same dtype on every rank, whatever its values (collectives over
    # these vectors, like the duplicated-data fingerprint, need identical layouts).
    if norms.dtype is not torch.float64:
        norms = norms.to(torch.float64)
    if not host_finite(norms):  # CPU memory: reading it is not a device sync
        for i in np.flatnonzero(np.isinf(norms.numpy())).tolist():
            source = tensors[order[i] if order is not None else i]
            norms[i] = torch.linalg.vector_norm(source, dtype=torch.float64)
    return norms


def host_finite(norms: torch.Tensor) -> bool:
    """No NaN/Inf in a CPU vector (they propagate through the sum; a huge finite sum only
    costs a closer look). A Python sum of a short list beats numpy's per-call cost."""
    if norms.numel() <= 256:
        return math.isfinite(sum(norms.tolist()))
    return bool(math.isfinite(norms.numpy().sum()))


def _foreach_norm_grouped(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None) -> list:
    """``_foreach_norm`` per (device, dtype) group, results in input order, moved to one device."""
    first = tensors[0]
    if all(t.device == first.device and t.dtype == first.dtype for t in tensors):
        acc = _at_least(first.dtype, dtype)
        return list(_foreach_norm(list(tensors), acc))  # the common case: one kernel launch
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    out: list = [None] * len(tensors)
    target = torch.float64
    for (_, group_dtype), idx in groups.items():
        acc = _at_least(group_dtype, dtype)
        for i, n in zip(idx, _foreach_norm([tensors[i] for i in idx], acc), strict=True):
            out[i] = n.to(first.device, target, non_blocking=True)
    return out


def _at_least(have: torch.dtype, want: torch.dtype | None) -> torch.dtype | None:
    """The accumulation dtype for tensors of ``have``: ``want`` is a least width, so a wider
    tensor (float64 asked for float32) keeps its own (None)."""
    return None if want is None or have.itemsize >= want.itemsize else want


_foreach_norm = foreach_norm  # (group, dtype) -> one norm per tensor


@dataclass(slots=True)
class GradSummary:
    """Host-side view of one set of gradients after readback."""

    norm: float
    nonfinite: bool
    first_position: int
    kind: str | None
    group_norms: list[float]


def summarize_host(
    vector: NormVector,
    values: Sequence[float] | np.ndarray,
    index: ParamIndex,
    scale: float | None = None,
) -> GradSummary:
    """Global norm, group norms and the first non-finite parameter (first in backward order,
    ``ParamIndex.order``: where a NaN began) with its kind, from read-back per-parameter norms.
    ``scale``: the loss scale the gradients carried (divided out when ``vector.scaled``). Plain
    Python for small models (numpy's per-call cost dominates there), numpy for large ones."""
    if scale is not None and vector.scaled and scale > 0 and math.isfinite(scale):
        inv = 1.0 / scale
        values = [v * inv for v in values]
    positions = vector.positions
    if len(values) > 64:
        return _summarize_numpy(values, positions, index)
    group_of = index.group_of
    group_sq = [0.0] * index.n_groups
    total = 0.0
    first, kind = -1, None
    rank = index.order.rank
    for v, pos in zip(values, positions, strict=True):
        bad = v != v or v in (math.inf, -math.inf)
        if bad and (first < 0 or rank[pos] < rank[first]):
            first, kind = pos, ("nan" if v != v else "inf")
        sq = v * v
        total += sq
        group_sq[group_of[pos]] += sq
    return GradSummary(
        norm=math.sqrt(total),
        nonfinite=first >= 0,
        first_position=first,
        kind=kind,
        group_norms=[math.sqrt(g) for g in group_sq],
    )


def _summarize_numpy(values, positions, index: ParamIndex) -> GradSummary:
    norms = np.asarray(values, dtype=np.float64)
    pos = np.asarray(positions, dtype=np.int64)
    with np.errstate(over="ignore", invalid="ignore"):
        squares = norms * norms
        total = float(np.sqrt(squares.sum()))
        group_norms = np.sqrt(
            np.bincount(index.group_array[pos], weights=squares, minlength=index.n_groups)
        )
    bad = ~np.isfinite(norms)
    first, kind = -1, None
    if bad.any():
        bad_positions = pos[bad]
        slot = int(np.argmin(index.order.rank_array[bad_positions]))
        first = int(bad_positions[slot])
        kind = "nan" if math.isnan(norms[bad][slot]) else "inf"
    return GradSummary(
        norm=total,
        nonfinite=first >= 0,
        first_position=first,
        kind=kind,
        group_norms=[float(v) for v in group_norms],
    )


def full_pass(index: ParamIndex, *, scaled: bool = True) -> NormVector | None:
    """Per-parameter norms of every parameter's current ``.grad``: one fused pass."""
    grads = [p.grad for p in index.params]
    plan = index.stack_plan  # small models: same-shaped CPU gradients, the host-cost path
    if plan is not None and _uniform_cpu(grads) and not sync_audit():  # CPU: a free read
        return NormVector(plan.norms(grads), plan.order, scaled)
    if all(g is not None and not g.is_sparse for g in grads):  # the common case
        if not grads:
            return None
        return NormVector(per_param_norms(grads), index.all_positions, scaled)
    positions: list[int] = []
    present: list[torch.Tensor] = []
    for i, g in enumerate(grads):
        if g is not None:
            if g.is_sparse:
                g = g.coalesce().values()
            positions.append(i)
            present.append(g)  # .grad never requires grad: no detach needed
    if not present:
        return None
    return NormVector(per_param_norms(present), positions, scaled)
