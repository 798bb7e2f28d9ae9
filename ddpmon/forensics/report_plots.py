"""Plots of ``ddpmon report``: matplotlib figures rendered to inline SVG strings.

Why matplotlib SVG: the report must be one file that opens anywhere without a network and
without JavaScript (archived next to the run, attached to a ticket, printed). Static SVG text
has no script to fail and no CDN to reach; Plotly's offline bundle alone adds ~3.5 MB per file.
Heatmaps are embedded as one raster image inside the SVG (a data URI, still no request).

Readable from 2 to 1,024 ranks: up to ``TOPK`` ranks are drawn as lines; beyond that the ranks
become a median line with a p5-p95 band and a min-max band, plus lines only for the ``OUTLIERS``
ranks farthest from the median. Steps are binned to at most ``MAX_POINTS`` points per series.
"""

from __future__ import annotations

import io
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

TOPK = 8
OUTLIERS = 4
MAX_POINTS = 800
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


@dataclass(slots=True)
class Grid:
    """Per-rank series binned onto common x positions: ``values[rank_index, bin]``."""

    x: np.ndarray
    ranks: list[int]
    values: np.ndarray


def edges_for(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Bin edges covering steps ``lo..hi`` in at most MAX_POINTS bins, and the bins' x."""
    nbins = max(1, min(MAX_POINTS, hi - lo + 1))
    edges = np.linspace(lo, hi + 1, nbins + 1)
    if nbins == hi - lo + 1:
        return edges, np.arange(lo, hi + 1.0)
    return edges, (edges[:-1] + edges[1:]) / 2 - 0.5


def bin_onto(edges: np.ndarray, steps: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Mean of the finite ``values`` in each bin; NaN for a bin without one."""
    nbins = len(edges) - 1
    v = values.astype(float)
    ok = np.isfinite(v)
    idx = np.clip(np.searchsorted(edges, steps[ok], side="right") - 1, 0, nbins - 1)
    total = np.bincount(idx, weights=v[ok], minlength=nbins)
    count = np.bincount(idx, minlength=nbins)
    with np.errstate(all="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def grid(steps_by_rank: dict[int, np.ndarray], values_by_rank: dict[int, np.ndarray]) -> Grid:
    """Bin every rank's (step, value) pairs onto at most MAX_POINTS shared bins (bin means)."""
    ranks = sorted(steps_by_rank)
    allsteps = np.concatenate([steps_by_rank[r] for r in ranks]) if ranks else np.array([])
    if not len(allsteps):
        return Grid(np.array([]), ranks, np.zeros((len(ranks), 0)))
    edges, x = edges_for(int(allsteps.min()), int(allsteps.max()))
    out = np.vstack([bin_onto(edges, steps_by_rank[r], values_by_rank[r]) for r in ranks])
    return Grid(x, ranks, out)


def rank_lines(
    ax, g: Grid, label: str, *, log: bool = False, style: str = "-", color: int = 0
) -> None:
    """Per-rank lines for small worlds; bands plus outlier lines for large ones. Gaps (steps a
    series was not sampled, e.g. local norms every N steps) are bridged, sampled points marked."""
    if not g.values.size:
        return
    label = plain(label)
    if len(g.ranks) <= TOPK:
        for i, r in enumerate(g.ranks):
            ok = np.isfinite(g.values[i])
            sparse = ok.sum() < 0.5 * len(ok)
            ax.plot(g.x[ok], g.values[i][ok], style, lw=1.1, marker="." if sparse else None,
                    ms=4, color=COLORS[(i + color) % len(COLORS)], label=f"{label} rank {r}")
    else:
        with np.errstate(all="ignore"), quiet_nan_warnings():
            med = np.nanmedian(g.values, axis=0)
            p5, p95 = np.nanpercentile(g.values, [5, 95], axis=0)
            lo, hi = np.nanmin(g.values, axis=0), np.nanmax(g.values, axis=0)
        ax.fill_between(g.x, lo, hi, color="#1f77b4", alpha=0.12, lw=0, label=f"{label} min-max")
        ax.fill_between(g.x, p5, p95, color="#1f77b4", alpha=0.3, lw=0, label=f"{label} p5-p95")
        ax.plot(g.x, med, style, color="#1f77b4", lw=1.3, label=f"{label} median")
        for j, i in enumerate(outliers(g.values, med)):
            ax.plot(g.x, g.values[i], style, lw=0.9, color=COLORS[(j + 1 + color) % len(COLORS)],
                    label=f"rank {g.ranks[i]} (outlier)")
    if log:
        ax.set_yscale("log")


def outliers(values: np.ndarray, med: np.ndarray, k: int = OUTLIERS) -> list[int]:
    """Indices of at most ``k`` rows farthest from the median (mean |log ratio|, or |diff| for
    values that can be <= 0), and only those that stand out: a score above the ranks' median
    score plus 5 robust deviations (MAD), so a band of ordinary noise draws no extra line."""
    with np.errstate(all="ignore"), quiet_nan_warnings():
        if np.nanmin(values) > 0 and np.nanmin(med) > 0:
            dev = np.abs(np.log(values / med))
        else:
            dev = np.abs(values - med)
        score = np.nanmean(np.where(np.isfinite(dev), dev, np.nan), axis=1)
    score = np.where(np.isfinite(score), score, -1.0)
    valid = score[score >= 0]
    if not len(valid):
        return []
    centre = float(np.median(valid))
    mad = float(np.median(np.abs(valid - centre))) * 1.4826
    threshold = centre + 5 * max(mad, 1e-12)
    return [int(i) for i in np.argsort(-score)[:k] if score[i] > threshold]


def heatmap(ax, fig, x: np.ndarray, groups: Sequence[str], norms: np.ndarray) -> None:
    """Group x step heatmap of log10 norms (rows: groups)."""
    with np.errstate(all="ignore"):
        data = np.log10(np.where(norms > 0, norms, np.nan))
    data = np.where(np.isfinite(data), data, np.nan)
    extent = (float(x[0]) - 0.5, float(x[-1]) + 0.5, len(groups) - 0.5, -0.5) if len(x) else None
    import matplotlib  # optional: ddpmon[report]

    # NaN/Inf norms (and bins without data) stand out in red
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#d62728")
    im = ax.imshow(data, aspect="auto", interpolation="nearest", cmap=cmap, extent=extent)
    im.set_rasterized(True)
    ax.set_yticks(range(len(groups)))
    ax.set_yticklabels([plain(g[:28]) for g in groups], fontsize=7)
    fig.colorbar(im, ax=ax, label="log10 norm", pad=0.01)


def mark_steps(ax, steps: Sequence[int], color: str, label: str) -> None:
    for i, s in enumerate(steps[:50]):
        ax.axvline(s, color=color, lw=0.8, ls=":", label=plain(label) if i == 0 else None)


def plain(text: object) -> str:
    """``text`` as matplotlib must draw it: every ``$`` escaped, so a name from a run (a module
    group ``a${$``, a ``--compare`` directory ``b$^^$``) is printed as written, never parsed as
    mathtext (which raises on bad math); and a leading ``_`` behind a zero-width space, since
    matplotlib leaves a label that starts with one out of the legend (a group ``_backbone``, a
    run ``_base``). Every label, title and tick label goes through here."""
    drawn = str(text).replace("$", r"\$")
    return "\u200b" + drawn if drawn.startswith("_") else drawn


def figure(title: str, ylabel: str, height: float = 2.6):
    import matplotlib  # optional: ddpmon[report]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: ddpmon[report]

    fig, ax = plt.subplots(figsize=(10, height), layout="constrained")
    ax.set_title(plain(title), fontsize=10, loc="left")
    ax.set_xlabel("optimizer step", fontsize=8)
    ax.set_ylabel(plain(ylabel), fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, alpha=0.25)
    return fig, ax


def to_svg(fig, legend: bool = True) -> str:
    import matplotlib.pyplot as plt  # optional: ddpmon[report]

    ax = fig.axes[0]
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper right", ncol=2, framealpha=0.7)
    buf = io.StringIO()
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "ddpmon"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    text = re.sub(r"^<\?xml[^>]*>\s*", "", text)
    text = re.sub(r"<!DOCTYPE[^>]*>\s*", "", text)
    text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.S)  # RDF boilerplate
    return text


class quiet_nan_warnings:  # noqa: N801 - used as a context manager, like a function
    """Silence numpy's 'All-NaN slice' RuntimeWarnings for empty bins."""

    def __enter__(self):
        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("ignore", RuntimeWarning)

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)
