"""What ``ddpmon report`` plots, read one rank at a time so memory stays bounded at any scale.

A 1,024-rank run with 100k steps per rank holds ~100M rows; the report never keeps them. It
keeps the lowest rank's full history (reduced norms, group norms and the loss scale are the
same on every rank of a data-parallel run) and, for every rank, its per-rank series binned onto
at most ``MAX_POINTS`` steps (``ranks x series x bins`` floats: ~50 MB at 1,024 ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..recorder.history_read import History, iter_histories
from ..rundir.damage import ReadWarnings, read_json
from ..rundir.layout import PROGRESS_RE, RunDir
from . import report_plots as rp

PER_RANK = (
    "loss",
    "grad_local_norm",
    "duration_seconds",
    "data_wait_seconds",
    "memory_bytes",
    "collective_mean_seconds",
    "collective_max_seconds",
)
"""Columns plotted per rank (binned); everything else comes from the lowest rank."""


@dataclass(slots=True)
class RunView:
    path: Path
    first: History | None
    """The lowest usable rank's full history (None: no rank left a usable one)."""
    grids: dict[str, rp.Grid] = field(default_factory=dict)
    origin_steps: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    """Last step + 1 of each rank with a usable history."""
    used: list[int] = field(default_factory=list)
    """The ranks whose history the plots rest on."""
    damage: ReadWarnings = field(default_factory=ReadWarnings)

    @property
    def ranks(self) -> int:
        return len(self.rows)


def load_view(path: Path, damage: ReadWarnings | None = None) -> RunView:
    """Read every rank's history once, keeping only what the plots need; a damaged rank is
    skipped (named in ``damage``) and the others are still plotted."""
    run = RunDir(path)
    view = RunView(path, None, damage=damage if damage is not None else ReadWarnings(path))
    edges = x = None
    binned: dict[str, list[np.ndarray]] = {name: [] for name in PER_RANK}
    origins: set[int] = set()
    for rank, h in iter_histories(run, view.damage):
        if view.first is None:
            view.first = h
            edges, x = rp.edges_for(int(h.columns["step"][0]), _last_step(run, h, view.damage))
        view.used.append(rank)
        view.rows.append(int(h.columns["step"][-1]) + 1)
        origins.update(int(s) for s in h.columns["step"][h.columns["origin"]])
        steps = h.columns["step"]
        for name in PER_RANK:
            values = h.columns[name]
            if name == "memory_bytes":
                values = np.where(values >= 0, values / 2**30, np.nan)
            binned[name].append(rp.bin_onto(edges, steps, values))
    if view.first is not None:
        view.grids = {name: rp.Grid(x, view.used, np.vstack(binned[name])) for name in PER_RANK}
    view.origin_steps = sorted(origins)
    return view


def _last_step(run: RunDir, first: History, damage: ReadWarnings) -> int:
    """The lowest rank's last step, or later when a rank's progress file says it got further."""
    hi = int(first.columns["step"][-1])
    for p in run.ranked(PROGRESS_RE).values():
        step = (read_json(p, damage, kept="its last step not used") or {}).get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            hi = max(hi, step)
    return hi


def single(h: History, column: str) -> rp.Grid:
    """One series of one history, binned (a one-row grid)."""
    return rp.grid({h.rank: h.columns["step"]}, {h.rank: h.columns[column]})


def rank_mean(g: rp.Grid) -> rp.Grid:
    """The mean over ranks of a grid, as a one-row grid (an overlaid run is one line)."""
    with np.errstate(all="ignore"), rp.quiet_nan_warnings():
        return rp.Grid(g.x, [0], np.atleast_2d(np.nanmean(g.values, axis=0)))
