"""FSDP2's own collectives, each wrapped through FSDP2's public setters and otherwise unchanged:
the reduce-scatter shows ddpmon its input first (this rank's gradients before the reduction),
all-gathers and HSDP's replicate-dim all-reduce are timed. Also the layout they share: one
unit's parameters in the reduce-scatter input, and the per-parameter norms over it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...host_reads import host_read_free
from ...probes.comm import tensor_bytes
from ...probes.grads import host_finite, per_param_norms
from .flat_norms import FlatLayout, build_layout

if TYPE_CHECKING:
    from .source import FSDPSource

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )
except ImportError:  # pragma: no cover - torch without FSDP2
    AllGather = ReduceScatter = object  # type: ignore[assignment,misc]
    DefaultAllGather = DefaultReduceScatter = None  # type: ignore[assignment,misc]

_MAX_SLICES = 512


@dataclass(slots=True)
class FSDPUnit:
    """One FSDP2 parameter group: its parameters' positions and per-rank padded shard sizes,
    in the order FSDP2 lays them out in the reduce-scatter input."""

    positions: list[int]
    columns: list[int]
    reductions: int = 0
    hsdp: bool = False
    scattered: Any = None
    """Timer marking the end of this unit's last reduce-scatter: where HSDP's all-reduce over
    the replicate dim starts (FSDP2 issues it right after, in stream order on GPU)."""
    group: Any = None
    """The reduce-scatter's process group (read at install)."""
    alone: bool = False
    """The reduce-scatter group has one rank (FSDP2 on a size-1 dp mesh beside TP, HSDP with a
    size-1 shard dim): FSDP2 skips the reduce-scatter and copies its input to its output, both
    allocated through the comm (``ProbedReduceScatter.allocate``)."""
    pending_input: Any = None
    """``alone``: the buffer of the first of the two allocations (the input), until the second."""
    layout: FlatLayout | None = None
    """The precomputed indices of its reduce-scatter input on CPU (built at the first look)."""

    @property
    def row_numel(self) -> int:
        return sum(self.columns)


class ProbedReduceScatter(ReduceScatter):  # type: ignore[misc,valid-type]
    """FSDP2's reduce-scatter, unchanged, with a look at its input first."""

    def __init__(self, inner: Any, unit: FSDPUnit, source: FSDPSource) -> None:
        self.inner = inner
        self.unit = unit
        self.source = source

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device):
        buffer = self.inner.allocate(size, dtype=dtype, device=device)
        if self.unit.alone:
            try:
                self._skipped_reduce(buffer)
            except Exception as exc:  # never into FSDP2's backward
                self.source.env.on_error("grads", exc)
        return buffer

    def _skipped_reduce(self, buffer: torch.Tensor) -> None:
        """A one-rank group: FSDP2 allocates the input, copies this rank's gradients in, then
        allocates the output and copies the input over it, without calling the reduce-scatter.
        At the second allocation the input holds exactly what the reduce-scatter would have
        been given: observed as such, and under HSDP the replicate all-reduce's timer starts.
        An input left unpaired at backward end is dropped (``FSDPSource.on_backward_end``)."""
        unit = self.unit
        pending, unit.pending_input = unit.pending_input, None
        if pending is None:
            unit.pending_input = buffer
            return
        self.source.observe_reduce_input(unit, pending, unit.group)
        if unit.hsdp:
            unit.scattered = self.source.collectives.start(buffer)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        self.source.observe_reduce_input(self.unit, input_tensor, group)
        rec = self.source.collectives
        result = rec.call(
            "reduce_scatter",
            tensor_bytes(input_tensor),
            self.inner,
            output_tensor=output_tensor,
            input_tensor=input_tensor,
            group=group,
            op=op,
            async_op=async_op,
        )
        if self.unit.hsdp:
            self.unit.scattered = rec.start(output_tensor)
        return result


class TimedAllGather(AllGather):  # type: ignore[misc,valid-type]
    """FSDP2's all-gather, unchanged, timed (``all_gather``; bytes: the gathered output)."""

    def __init__(self, inner: Any, source: FSDPSource) -> None:
        self.inner = inner
        self.source = source

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        return self.source.collectives.call(
            "all_gather",
            tensor_bytes(output_tensor),
            self.inner,
            output_tensor=output_tensor,
            input_tensor=input_tensor,
            group=group,
            async_op=async_op,
        )


class AllReduceTimer:
    """HSDP: FSDP2's all-reduce hook runs right after the replicate-dim all-reduce (on its
    stream): the time since the unit's reduce-scatter ended is that all-reduce. Calls the
    user's own hook, if any, after."""

    def __init__(self, unit: FSDPUnit, source: FSDPSource, inner: Any) -> None:
        self.unit = unit
        self.source = source
        self.inner = inner

    def __call__(self, reduce_output: torch.Tensor) -> None:
        start, self.unit.scattered = self.unit.scattered, None
        if start is not None:
            self.source.collectives.stop("all_reduce", start, tensor_bytes(reduce_output))
        if self.inner is not None:
            self.inner(reduce_output)


def unit_norms(unit: FSDPUnit, flat: torch.Tensor, world: int) -> torch.Tensor:
    """Per-parameter norms of one unit's reduce-scatter input. On CPU a fixed handful of calls
    over precomputed indices (``flat_norms``), measured again with the general pass when the
    result is not finite (an overflowed float32 row or a real NaN/Inf: read on the host, CPU
    memory); elsewhere :func:`row_chunk_norms`."""
    if not host_read_free(flat.device):
        return row_chunk_norms(flat, world, unit.columns)
    layout = unit.layout
    if layout is None or layout.numel != flat.numel():
        layout = unit.layout = build_layout(world, unit.columns, flat.device)
    norms = layout.norms(flat)
    return norms if host_finite(norms) else row_chunk_norms(flat, world, unit.columns)


def row_chunk_norms(flat: torch.Tensor, world: int, columns: list[int]) -> torch.Tensor:
    """Per-parameter norms over a reduce-scatter input of ``world`` rows, each the concatenation
    of every parameter's padded chunk (``columns`` wide). Contiguous 1-D slices, one per (row,
    parameter), keep ``_foreach_norm`` on its fused path (strided 2-D views are ~2.5x slower on
    CPU and fall off the fused CUDA kernel); the rows are then combined per parameter. Beyond
    ``_MAX_SLICES`` slices the host cost of building them wins, so one strided view per
    parameter is used instead."""
    row = sum(columns)
    if world * len(columns) > _MAX_SLICES:  # large worlds: fewer, strided views (less host work)
        rows = flat.view(world, row)
        views, start = [], 0
        for width in columns:
            views.append(rows[:, start : start + width])
            start += width
        return per_param_norms(views).to(torch.float64)
    views = []
    for r in range(world):
        start = r * row
        for width in columns:
            views.append(flat[start : start + width])
            start += width
    pieces = per_param_norms(views).to(torch.float64).view(world, len(columns))
    return (pieces * pieces).sum(dim=0).sqrt()
