"""Per-parameter norms of one FSDP2 reduce-scatter input in a fixed number of torch calls, on CPU.

The input is one contiguous buffer: ``world`` rows, each the concatenation of every parameter's
padded chunk. Its layout is fixed per unit, so everything that depends on it is computed once
(:class:`FlatLayout`) and each step runs the same few calls whatever the parameter count:

- the buffer's body as rows of ``CHUNK`` elements on one global grid: one float32 norm per row
  (one ``vector_norm`` call, the only full pass; on one CPU thread it costs what a ``sum`` of
  the buffer costs), squared and added per parameter in float64 with one ``index_add_`` over a
  precomputed row-to-parameter index. A row is counted only if it lies inside one parameter's
  chunk of a large (more than ``SMALL_NUMEL`` elements) parameter;
- every other element (the chunks of small parameters, the head and tail of each large chunk
  that share a grid row with a neighbour, the buffer's tail): gathered with one precomputed
  index, squared and added per parameter in float64.

That is the precision :func:`ddpmon.probes.grads.per_param_norms` gives (float32 rows of
``CHUNK`` whose squares add in float64, small tensors in float64). A row whose float32 norm
overflows, and a real NaN or Inf, make the result non-finite: the caller then measures again
with the general pass, which tells the two apart (read on the host: CPU memory, no sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...probes.grads import CHUNK, SMALL_NUMEL

_WIDE = (torch.float32, torch.float64)


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """The precomputed indices of one unit's reduce-scatter input (one device, one size)."""

    numel: int
    params: int
    body_rows: int
    """Rows of ``CHUNK`` on the global grid (the buffer's first ``body_rows * CHUNK`` elements)."""
    row_param: torch.Tensor
    """int64 per body row: its parameter, or ``params`` (a discarded slot) for a shared row."""
    loose: torch.Tensor
    """int64 element positions measured one by one in float64."""
    loose_param: torch.Tensor
    """int64 per loose element: its parameter."""

    def norms(self, flat: torch.Tensor) -> torch.Tensor:
        """float64 norm per parameter over every rank row of ``flat`` (padding included)."""
        acc = None if flat.dtype in _WIDE else torch.float32
        out = torch.zeros(self.params + 1, dtype=torch.float64, device=flat.device)
        if self.body_rows:
            rows = flat[: self.body_rows * CHUNK].view(self.body_rows, CHUNK)
            squares = torch.linalg.vector_norm(rows, dim=1, dtype=acc).double().square_()
            out.index_add_(0, self.row_param, squares)
        if self.loose.numel():
            loose = flat.index_select(0, self.loose).double().square_()
            out.index_add_(0, self.loose_param, loose)
        return out[: self.params].sqrt_()


def build_layout(world: int, columns: list[int], device: torch.device) -> FlatLayout:
    """The indices for a reduce-scatter input: ``world`` rows of ``columns``-wide chunks (see
    module doc), padding included."""
    row = sum(columns)
    segments, start = [], 0
    for _ in range(world):
        for p, width in enumerate(columns):
            segments.append((start, width, p))
            start += width
    return segment_layout(segments, world * row, len(columns), device)


def segment_layout(
    segments: list[tuple[int, int, int]], numel: int, params: int, device: torch.device
) -> FlatLayout:
    """The indices for a buffer of ``numel`` elements whose ``(start, length, parameter)``
    segments are measured (disjoint; elements outside every segment are not counted)."""
    body_rows = numel // CHUNK
    row_param = torch.full((body_rows,), params, dtype=torch.int64)
    loose: list[torch.Tensor] = []
    loose_param: list[torch.Tensor] = []

    def add_loose(begin: int, stop: int, p: int) -> None:
        if stop > begin:
            loose.append(torch.arange(begin, stop, dtype=torch.int64))
            loose_param.append(torch.full((stop - begin,), p, dtype=torch.int64))

    for start, width, p in segments:
        end = start + width
        first = -(-start // CHUNK)  # the first grid row that starts inside the segment
        last = min(end // CHUNK, body_rows)  # one past the last that ends inside it
        if width > SMALL_NUMEL and last > first:
            row_param[first:last] = p
            add_loose(start, first * CHUNK, p)
            add_loose(last * CHUNK, end, p)
        else:
            add_loose(start, end, p)
    loose_idx = torch.cat(loose) if loose else torch.zeros(0, dtype=torch.int64)
    loose_of = torch.cat(loose_param) if loose_param else torch.zeros(0, dtype=torch.int64)
    return FlatLayout(
        numel=numel,
        params=params,
        body_rows=body_rows,
        row_param=row_param.to(device),
        loose=loose_idx.to(device),
        loose_param=loose_of.to(device),
    )


__all__ = ["FlatLayout", "build_layout", "segment_layout"]
