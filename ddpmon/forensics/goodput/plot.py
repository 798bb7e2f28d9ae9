"""Goodput in ``ddpmon report``: the ratios, a table of the buckets and a stacked bar per
attempt (each bar is that attempt's wall-clock time, split into the buckets)."""

from __future__ import annotations

import html
from typing import Any

from ..report_plots import plain, to_svg
from . import of_timeline
from .account import Goodput
from .buckets import BUCKETS

COLORS = {
    "productive": "#2ca02c", "wasted_progress_from_disruption": "#d62728",
    "initialization": "#9467bd", "program_startup": "#c5b0d5", "data_loading_sync": "#ff7f0e",
    "unproductive_checkpoint_save": "#1f77b4", "unproductive_checkpoint_restore": "#aec7e8",
    "failure_detection": "#8c564b", "restart_gap": "#7f7f7f", "custom_badput_events": "#bcbd22",
    "other": "#dddddd",
}
MAX_BARS = 40
"""Attempts drawn (the first and last halves beyond it); the table keeps the run's totals."""


def section(tl: Any) -> str:
    """The report's goodput section for a built timeline ('' when it cannot be computed)."""
    g = of_timeline(tl) if tl is not None else None
    if g is None or g.wall_seconds <= 0:
        return ""
    rows = "".join(
        f"<tr><td>{html.escape(b.name)}</td><td>{g.buckets[b.name]:.3f}</td>"
        f"<td>{100 * g.buckets[b.name] / g.wall_seconds:.1f}%</td>"
        f"<td>{html.escape(b.google)}</td></tr>" for b in BUCKETS)
    estimated = "".join(f'<p class="muted">estimated: {html.escape(e)}</p>' for e in g.estimated)
    return (
        '<h2 id="goodput">Goodput</h2>'
        f"<p>Goodput {_pct(g.goodput)} (productive step time / wall-clock), ETTR "
        f"{_pct(g.ettr)}, over {g.wall_seconds:.1f} s from the first process start; mean over "
        f"{len(g.ranks)} rank(s). Definitions: docs/goodput.md.</p>"
        f'<figure class="plot" id="plot-goodput">{_bars(g)}</figure>'
        "<table><tr><th>bucket</th><th>seconds</th><th>share</th>"
        f"<th>ml-goodput-measurement</th></tr>{rows}</table>{estimated}"
    )


def _bars(g: Goodput) -> str:
    import matplotlib  # optional: ddpmon[report]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: ddpmon[report]


    attempts = g.attempts
    if len(attempts) > MAX_BARS:
        attempts = attempts[: MAX_BARS // 2] + attempts[-MAX_BARS // 2:]
    fig, ax = plt.subplots(figsize=(10, max(2.6, 0.5 + 0.35 * len(attempts))), layout="constrained")
    ax.set_title("Wall-clock time by attempt", fontsize=10, loc="left")
    ax.set_xlabel("seconds", fontsize=8)
    ax.tick_params(labelsize=7)
    labels = [plain(f"attempt {a['attempt']}") for a in attempts]
    left = [0.0] * len(attempts)
    for b in BUCKETS:
        widths = [a["buckets"][b.name] for a in attempts]
        if not any(widths):
            continue
        ax.barh(labels, widths, left=left, color=COLORS.get(b.name), label=plain(b.name))
        left = [x + w for x, w in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    return to_svg(fig)


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"
