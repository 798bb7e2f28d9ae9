"""The per-group update figures of a history (``probes.updates``) for ``compare`` and
``report``: sampled steps only (NaN elsewhere), one row per group.

``compare`` gets one ``ratio:<group>`` series per group (the update/weight ratio), compared on
the steps both runs sampled; ``report`` gets two group x step heatmaps (update/weight ratio and
the first moment's norm) binned like the gradient-norm heatmap, and the run's ``loss_spike``
events as marks on the loss plot's steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..recorder.history_read import History
from . import report_plots as rp

RATIO_PREFIX = "ratio:"


def ratio_series(history: History) -> dict[str, np.ndarray]:
    """``ratio:<group>`` -> the group's update/weight ratio per row (NaN: not sampled); empty
    for a history without sampled steps (older files, ``update_every=0``)."""
    ratios = history.columns.get("update_ratios")
    if ratios is None or not ratios.size or not np.isfinite(ratios).any():
        return {}
    return {f"{RATIO_PREFIX}{g}": ratios[:, i] for i, g in enumerate(history.groups)}


def both_sampled(name: str, x: np.ndarray, y: np.ndarray) -> Any:
    """The steps a series is compared on: for a ratio, those both runs sampled (runs sampled at
    different intervals are compared where they meet); every step otherwise."""
    if not name.startswith(RATIO_PREFIX):
        return slice(None)
    return np.isfinite(x) & np.isfinite(y)


def update_figures(history: History, fig_html: Callable[..., str]) -> list[str]:
    """The report's update heatmaps (``fig_html(name, fig, legend=False)`` renders one)."""
    out: list[str] = []
    if not len(history.columns["step"]) or not history.groups:
        return out
    for column, title in (
        ("update_ratios", "Update/weight ratio ||dw||/||w|| per group (sampled steps), "
                          "group x step"),
        ("exp_avg_norms", "Optimizer first moment norm per group (Adam family), group x step"),
    ):
        values = history.columns.get(column)
        if values is None or not np.isfinite(values).any():
            continue
        x, rows = _sampled(history.columns["step"], values)
        fig, ax = rp.figure(title, "", 0.9 + 0.22 * len(history.groups))
        rp.heatmap(ax, fig, x, history.groups, rows)
        out.append(fig_html(column, fig, legend=False))
    return out


def _sampled(steps: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x, groups x columns) over the sampled steps only, binned to at most ``rp.MAX_POINTS``
    columns (a heatmap over every step would be mostly empty columns)."""
    keep = np.isfinite(values).any(axis=1)
    steps, values = steps[keep], values[keep]
    if len(steps) <= rp.MAX_POINTS:
        return steps.astype(float), values.T
    edges = np.linspace(steps[0], steps[-1] + 1, rp.MAX_POINTS + 1)
    x = (edges[:-1] + edges[1:]) / 2 - 0.5
    return x, np.vstack([rp.bin_onto(edges, steps, values[:, i]) for i in range(values.shape[1])])


__all__ = ["RATIO_PREFIX", "both_sampled", "ratio_series", "update_figures"]
