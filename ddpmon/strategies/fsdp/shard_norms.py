"""The end-of-backward pass over FSDP2's sharded gradients, per unit in a fixed number of calls.

After a reduce-scatter, FSDP2 makes each sharded gradient a view into the unit's output buffer
(``as_strided`` at the parameter's offset of the padded row), so one unit's gradients lie side
by side in one storage, in the unit's order. Where they do (checked every step from metadata
only: storage, offset, size; no device read), the unit's per-parameter norms come from one
:class:`~.flat_norms.FlatLayout` pass over that storage, the padding between them not counted.
Anything else (a gradient accumulated into an older one, a parameter without a gradient, a
user's replaced gradient, an accelerator, a non-finite result) answers None, and
``ShardedNorms`` takes its general pass (:func:`ddpmon.probes.grads.per_param_norms`), which
is also the one that tells an overflowed float32 row from a real NaN or Inf.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...host_reads import host_read_free
from ...probes.grads import host_finite
from .flat_norms import FlatLayout, segment_layout


@dataclass(slots=True)
class _UnitShards:
    positions: list[int]
    offsets: list[int]
    """Each parameter's offset in the unit's padded shard row (cumulative padded widths)."""
    widths: list[int]
    layout: FlatLayout | None = None
    numels: tuple[int, ...] = ()
    """The local sizes the layout was built for."""


class ShardPass:
    """Per-parameter norms of the local shards, unit by unit (see module doc)."""

    def __init__(self, units: Sequence[tuple[list[int], list[int]]], params: int) -> None:
        """``units``: (positions, padded widths) per FSDP2 unit; ``params``: the index's size.
        Usable only when the units cover every position once."""
        self._units: list[_UnitShards] = []
        covered: list[int] = []
        for positions, columns in units:
            offsets, at = [], 0
            for width in columns:
                offsets.append(at)
                at += width
            self._units.append(_UnitShards(list(positions), offsets, list(columns)))
            covered.extend(positions)
        self.params = params
        self.usable = sorted(covered) == list(range(params)) and params > 0
        self._inverse: torch.Tensor | None = None
        """Index order from the units' order (the root unit comes first), when they differ."""
        if self.usable and covered != list(range(params)):
            self._inverse = torch.argsort(torch.tensor(covered, dtype=torch.int64))

    def __call__(self, idx: Sequence[int], raw: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """float64 norms of ``raw`` (the local pieces of the gradients at ``idx``), or None."""
        if not self.usable or len(idx) != self.params or len(raw) != self.params:
            return None  # a parameter without a gradient: the general pass
        if not host_read_free(raw[0].device):
            return None  # an accelerator: one fused kernel there already
        parts = []
        for unit in self._units:
            norms = self._unit(unit, raw)
            if norms is None:
                return None
            parts.append(norms)
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        if self._inverse is not None:
            out = out.index_select(0, self._inverse.to(out.device))
        return out if host_finite(out) else None  # CPU memory: no sync

    def _unit(self, unit: _UnitShards, raw: Sequence[torch.Tensor]) -> torch.Tensor | None:
        pieces = [raw[p] for p in unit.positions]
        first = pieces[0]
        storage = first.untyped_storage().data_ptr()
        base = first.storage_offset()
        for piece, offset, width in zip(pieces, unit.offsets, unit.widths, strict=True):
            if (
                piece.untyped_storage().data_ptr() != storage
                or piece.storage_offset() != base + offset
                or piece.numel() > width
                or piece.dtype != first.dtype
                or not piece.is_contiguous()
            ):
                return None
        numels = tuple(p.numel() for p in pieces)
        span = unit.offsets[-1] + numels[-1]
        if unit.layout is None or unit.numels != numels:
            segments = [(o, n, k) for k, (o, n) in enumerate(zip(unit.offsets, numels,
                                                                 strict=True))]
            unit.layout = segment_layout(segments, span, len(pieces), first.device)
            unit.numels = numels
        flat = first.as_strided((span,), (1,), base)
        return unit.layout.norms(flat)


__all__ = ["ShardPass"]
