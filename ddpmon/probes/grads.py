"""Gradient norms and non-finite detection in one fused pass, without a host sync.

Per-parameter L2 norms come from ``torch._foreach_norm`` (one read of every gradient). Everything
else (global norm, per-group norms, the first non-finite parameter and its kind) is derived from
that small vector on the device.

Exactness: a float32 norm overflows to inf for finite values above ~1e19, which would look like an
Inf gradient. On CUDA the norms accumulate in float64 (memory-bound either way, so free), which
cannot overflow for fp32/fp16/bf16 gradients. On CPU float64 costs ~3.7x, so norms are float32 and
an inf norm is re-checked in float64 for that tensor only: CPU tensors can be read without any
device sync, so this rare path is exact and cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Layout of a grad summary vector (float64, on the gradients' device).
SUMMARY_NORM, SUMMARY_ANY_BAD, SUMMARY_FIRST, SUMMARY_KIND = 0, 1, 2, 3
SUMMARY_FIXED = 4
KIND_NAMES = {1: "nan", 2: "inf"}


class ParamIndex:
    """Stable indices, names and bounded groups of a model's trainable parameters."""

    def __init__(self, model: torch.nn.Module, group_depth: int = 1, max_groups: int = 32) -> None:
        inner = getattr(model, "module", model)  # DDP/FSDP-style wrappers keep the model here
        named = [(n, p) for n, p in inner.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.names = [n for n, _ in named]
        self.position = {id(p): i for i, p in enumerate(self.params)}
        self.group_names, self.group_of = _groups(self.names, group_depth, max_groups)
        self._layouts: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self.params)

    @property
    def n_groups(self) -> int:
        return len(self.group_names)

    def layout(
        self, positions: Sequence[int], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Device tensors (param positions, group ids) for a list of positions, built once per
        distinct layout (DDP rebuilds its buckets once, after the first iteration)."""
        key = (tuple(positions), str(device))
        cached = self._layouts.get(key)
        if cached is None:
            pos = torch.tensor(list(positions), dtype=torch.long)
            grp = torch.tensor([self.group_of[i] for i in positions], dtype=torch.long)
            if device.type != "cpu":
                pos = pos.pin_memory().to(device, non_blocking=True)
                grp = grp.pin_memory().to(device, non_blocking=True)
            cached = (pos, grp)
            if len(self._layouts) > 64:  # bounded: layouts only change on re-bucketing
                self._layouts.clear()
            self._layouts[key] = cached
        return cached


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
    """float64 vector of L2 norms, one per tensor, computed in one fused pass (see module doc)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    device = tensors[0].device
    if device.type == "cpu":
        norms = torch.stack(_foreach_norm_grouped(tensors, None)).to(torch.float64)
        if torch.isinf(norms).any():  # CPU tensor: reading it is not a device sync
            for i in torch.nonzero(torch.isinf(norms)).flatten().tolist():
                norms[i] = torch.linalg.vector_norm(tensors[i], dtype=torch.float64)
        return norms
    return torch.stack(_foreach_norm_grouped(tensors, torch.float64))


def _foreach_norm_grouped(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None) -> list:
    """``_foreach_norm`` per (device, dtype) group, results in input order, moved to one device."""
    first = tensors[0]
    if all(t.device == first.device and t.dtype == first.dtype for t in tensors):
        return list(_foreach_norm(list(tensors), dtype))  # the common case: one kernel launch
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    out: list = [None] * len(tensors)
    for idx in groups.values():
        for i, n in zip(idx, _foreach_norm([tensors[i] for i in idx], dtype), strict=True):
            out[i] = n.to(first.device, non_blocking=True) if n.device != first.device else n
    return out


def _foreach_norm(group: list[torch.Tensor], dtype: torch.dtype | None) -> Sequence:
    try:
        return (
            torch._foreach_norm(group, 2, dtype=dtype) if dtype else torch._foreach_norm(group, 2)
        )
    except (TypeError, RuntimeError):  # older torch without the dtype argument
        return [torch.linalg.vector_norm(t, dtype=dtype) for t in group]


def summarize(
    norms: torch.Tensor,
    positions: torch.Tensor,
    groups: torch.Tensor,
    n_params: int,
    n_groups: int,
    inv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Device vector ``[norm, any_bad, first_position, kind, group_norm_0..]`` (float64).

    ``first_position`` is the smallest parameter position (registration order) whose gradient is
    non-finite, or -1; ``kind`` is 1 for NaN, 2 for Inf, 0 for none.
    """
    if inv_scale is not None:
        norms = norms * inv_scale.to(norms.dtype)
    sq = norms * norms
    group_norms = torch.zeros(n_groups, dtype=norms.dtype, device=norms.device)
    group_norms.index_add_(0, groups, sq).sqrt_()
    bad = ~torch.isfinite(norms)
    # Smallest bad position (registration order) and where it sits, in one reduction.
    first, slot = torch.min(positions.masked_fill(~bad, n_params), dim=0)
    any_bad = first < n_params
    first_is_nan = torch.isnan(norms.gather(0, slot.reshape(1))).reshape(())
    kind = (2 - first_is_nan.to(norms.dtype)) * any_bad  # 1 = NaN, 2 = Inf, 0 = none
    head = torch.stack(
        [
            sq.sum().sqrt(),
            any_bad.to(norms.dtype),
            first.masked_fill(~any_bad, -1).to(norms.dtype),
            kind,
        ]
    )
    return torch.cat([head, group_norms])


@dataclass(slots=True)
class GradSummary:
    """Host-side view of a summary vector after readback."""

    norm: float
    nonfinite: bool
    first_position: int
    kind: str | None
    group_norms: list[float]

    @classmethod
    def from_values(cls, values: Sequence[float]) -> GradSummary:
        any_bad = values[SUMMARY_ANY_BAD] > 0.5
        return cls(
            norm=float(values[SUMMARY_NORM]),
            nonfinite=any_bad,
            first_position=int(values[SUMMARY_FIRST]) if any_bad else -1,
            kind=KIND_NAMES.get(int(values[SUMMARY_KIND])) if any_bad else None,
            group_norms=[float(v) for v in values[SUMMARY_FIXED:]],
        )


def summary_width(n_groups: int) -> int:
    return SUMMARY_FIXED + n_groups


def full_pass(index: ParamIndex, inv_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """Summary of every parameter's current ``.grad`` (the non-DDP path, or DDP fallback)."""
    positions: list[int] = []
    grads: list[torch.Tensor] = []
    for i, p in enumerate(index.params):
        g = p.grad
        if g is not None:
            if g.is_sparse:
                g = g.coalesce()._values()
            positions.append(i)
            grads.append(g.detach())
    if not grads:
        return None
    norms = per_param_norms(grads)
    pos, grp = index.layout(positions, norms.device)
    return summarize(norms, pos, grp, len(index), index.n_groups, inv_scale)
