"""The host side of the update probe (``probes.updates``): one sampled step's read-back squares
folded into per-group figures. Record thread; nothing here touches a device."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..probes.grads import ParamIndex

FIELDS = ("weight_norm", "update_norm", "update_ratio", "exp_avg_norm", "exp_avg_sq_norm")
"""Per-group figures, in the order the history stores them."""


def group_stats(values: Sequence[float], index: ParamIndex) -> dict[str, dict[str, float]]:
    """``group -> {field: value}`` from the probe's vector (``2n`` or ``4n`` squared norms:
    weights, updates, then the moments when the optimizer keeps them). Squares add within a
    group; ``update_ratio`` is ``update_norm / weight_norm`` (absent for all-zero weights)."""
    n = len(index)
    blocks = len(values) // n if n else 0
    if n == 0 or blocks not in (2, 4) or blocks * n != len(values):
        raise ValueError(f"update vector of {len(values)} values for {n} parameters")
    rows = np.asarray(values, dtype=np.float64).reshape(blocks, n)
    sums = [np.bincount(index.group_array, weights=row, minlength=index.n_groups)
            for row in rows]
    out: dict[str, dict[str, float]] = {}
    for g, name in enumerate(index.group_names):
        weight, update = math.sqrt(max(sums[0][g], 0.0)), math.sqrt(max(sums[1][g], 0.0))
        figures = {"weight_norm": weight, "update_norm": update}
        if weight > 0:
            figures["update_ratio"] = update / weight
        if blocks == 4:
            figures["exp_avg_norm"] = math.sqrt(max(sums[2][g], 0.0))
            figures["exp_avg_sq_norm"] = math.sqrt(max(sums[3][g], 0.0))
        out[name] = figures
    return out


__all__ = ["FIELDS", "group_stats"]
