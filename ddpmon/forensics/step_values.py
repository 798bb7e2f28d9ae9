"""The history's step values that no hand-written view names: declared step fields marked
``compare`` (``step_fields.COMPARED``) and the per-step metrics' columns. ``compare`` compares
them and ``report`` plots them, both from the lowest usable rank, so a new step value reaches
both without an edit here."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..metrics.step_fields import COMPARED
from ..recorder.history_read import History
from . import report_plots as rp
from .report_data import single


def value_series(history: History) -> dict[str, np.ndarray]:
    """``column -> values`` of the step values ``history`` holds, declared fields first."""
    out = {f.name: history.columns[f.name] for f in COMPARED if f.name in history.columns}
    out.update((name, history.columns[name]) for name in history.step_values)
    return out


def value_figures(history: History, fig_html: Callable[..., str]) -> list[str]:
    """The report's "Step values" section: one figure per step value with a finite value
    (none: no section, so a run without any reads as before)."""
    out: list[str] = []
    for name, values in value_series(history).items():
        if not np.isfinite(values).any():
            continue
        fig, ax = rp.figure(f"{name} (lowest rank)", name)
        rp.rank_lines(ax, single(history, name), name)
        out.append(fig_html(f"value-{name}", fig))
    return ['<h2 id="step-values">Step values</h2>', *out] if out else []
