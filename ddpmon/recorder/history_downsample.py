"""Which steps the history keeps (:class:`Downsampler`): bounded rows however long the run."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .history_schema import COL

_NOTABLE = tuple(
    COL[n]
    for n in (
        "grad_nonfinite", "local_nonfinite", "origin", "poisoned", "amp_skipped", "skipped_by"
    )
)


def _notable(row: tuple) -> bool:
    loss = row[COL["loss"]]
    nonfinite_loss = loss is not None and not math.isfinite(loss)
    return nonfinite_loss or any(row[i] for i in _NOTABLE)


@dataclass(slots=True)
class Downsampler:
    """Which rows to keep: every step for ``full_rows`` rows, then a stride doubling every
    ``segment_rows`` kept rows; notable rows always (up to ``notable_max`` extra)."""

    full_rows: int = 100_000
    segment_rows: int = 25_000
    notable_max: int = 10_000
    kept: int = 0
    stride: int = 1
    since_change: int = 0
    extra_notable: int = 0

    def keep(self, row: tuple) -> bool:
        if self.kept >= self.full_rows and self.since_change >= (
            self.segment_rows if self.stride > 1 else 0
        ):
            self.stride *= 2
            self.since_change = 0
        on_stride = self.stride == 1 or row[COL["step"]] % self.stride == 0
        if not on_stride:
            if not _notable(row) or self.extra_notable >= self.notable_max:
                return False
            self.extra_notable += 1
        self.kept += 1
        if self.stride > 1:
            self.since_change += 1
        return True


__all__ = ["Downsampler"]
