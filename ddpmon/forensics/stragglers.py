"""Who held a run back, by how much, since which step and why: straggler attribution from the
per-rank histories' step parts (``agent.step_split``).

Under synchronous data parallelism every rank's iteration lasts as long as the slowest rank's;
the fast ranks spend the difference waiting inside the gradient all-reduce. So a rank's *own*
time (data wait, forward, backward, optimizer and host time: everything but ``wait``) is what is
compared across ranks, never its step time:

- steps are cut into windows of :data:`WINDOW` steps (wider for long runs, so the work stays
  bounded); each rank's window value is the :data:`FLOOR` quantile (0.2) of the window's steps
  (descheduled steps only add time, so they move nothing);
- a rank's *slowdown* in a window is its own time over the median of the *other* ranks', less
  one (a median that held the straggler itself would halve its slowdown in a 2-rank run);
  under pipeline parallel a rank is compared with the ranks of its stage (:func:`peer_groups`):
  a stage's bubble is ``wait`` (never its own time) and a slow stage is named with ``stage``;
- a rank is a straggler when its slowdown is at least ``threshold`` (default 5 %) and the
  largest of the run in :data:`SUSTAIN` consecutive windows; it is named once per streak,
  from the streak's first step (``since_step``);
- its *cause* is the part whose excess over the other ranks' median is the largest over the streak:
  ``data`` (the wait before the first forward), ``compute`` (forward, backward and optimizer),
  ``host`` (the loop's own code inside the step) or ``communication`` (the time it spent
  issuing its own collectives: a slow path to the network, ``probes.comm_issue``).

A link that slows a ring alike for every rank grows no rank's own time and is not named here
(the run's collective times show it: ``DdpmonCollectiveSlow``).

The warm-up (the first :data:`WARMUP` steps of a rank's history) is left out: first compiles,
allocator growth and a first collective's connection set-up are not a straggler.
"""

from __future__ import annotations

import html
import math
from typing import Any

import numpy as np

from ..recorder.history_read import iter_histories
from ..rundir.damage import ReadWarnings
from ..rundir.layout import RunDir

WINDOW = 10
"""Steps per window (short runs)."""
MAX_WINDOWS = 2_000
"""Windows kept per rank: a longer run widens the window instead (memory stays bounded)."""
SUSTAIN = 3
"""Consecutive windows a rank must lead the run above the threshold to be named."""
WARMUP = 5
"""First steps of a history left out."""
THRESHOLD = 0.05
"""Default slowdown (own time over the other ranks' median, less one) that names a straggler."""
FLOOR = 0.2
"""The quantile of a window's steps that is its value: interference from outside the run (other
processes, a shared cache) only ever adds time, so a low quantile is the work's own cost."""
MAX_NAMED = 16
"""Streaks listed at most (the largest slowdowns first)."""
CAUSES = ("data", "compute", "host", "communication")


def find_stragglers(run: RunDir, damage: ReadWarnings | None = None,
                    threshold: float = THRESHOLD) -> list[dict[str, Any]]:
    """The run's stragglers, the largest slowdown first: ``rank``, ``cause``, ``slowdown`` (a
    fraction: 0.15 is 15 % slower than the other ranks' median), ``since_step``, ``until_step`` (the
    last step of the streak) and ``excess_seconds`` (per step, by cause). Empty without step
    parts (histories written before them, or one rank)."""
    damage = damage if damage is not None else ReadWarnings()
    width: int | None = None
    windows: dict[int, dict[int, tuple[float, ...]]] = {}
    stages: dict[int, str] = {}
    for rank, history in iter_histories(run, damage):
        if width is None:
            width = _window_width(history.columns["step"])
        mine = rank_windows(history.columns, width)
        if mine:
            windows[rank] = mine
            if history.stage is not None:
                stages[rank] = history.stage
    if len(windows) < 2 or width is None:
        return []
    found: list[dict[str, Any]] = []
    for group in peer_groups(list(windows), stages):
        named = name_stragglers({r: windows[r] for r in group}, width, threshold)
        found += [s | {"stage": stages[s["rank"]]} if s["rank"] in stages else s for s in named]
    found.sort(key=lambda s: (-s["slowdown"], s["rank"]))
    return found[:MAX_NAMED]


def peer_groups(ranks: list[int], stages: dict[int, str]) -> list[list[int]]:
    """The ranks compared with each other. Pipeline parallel: the ranks holding the same
    stage(s) (its data-parallel replicas do the same work), when every stage has 2 ranks or
    more; with one rank per stage, every rank together (the stages' own times, bubbles left
    out as waits: the slowest stage is the pipeline's bottleneck). Otherwise one group."""
    if not stages:
        return [ranks]
    groups: dict[str, list[int]] = {}
    for rank in ranks:
        groups.setdefault(stages.get(rank, ""), []).append(rank)
    if all(len(g) >= 2 for g in groups.values()):
        return list(groups.values())
    return [ranks]


def _window_width(steps: Any) -> int:
    span = int(steps.max() - steps.min()) + 1 if len(steps) else 0
    return max(WINDOW, math.ceil(span / MAX_WINDOWS))


def rank_windows(columns: dict[str, Any], width: int
                 ) -> dict[int, tuple[float, ...]]:
    """``window -> (own, data, compute, host, communication)``, the :data:`FLOOR` quantiles of
    one rank's steps in each window (``step // width``), warm-up and steps without parts left
    out."""
    steps = columns["step"]
    if "wait_seconds" not in columns or not len(steps):
        return {}
    data = np.nan_to_num(columns["data_wait_seconds"], nan=0.0)
    compute = (columns["forward_seconds"] + columns["backward_seconds"]
               + columns["optimizer_seconds"])
    host = columns["host_seconds"]
    comm = columns.get("communication_seconds")  # absent before it (read as 0)
    comm = np.zeros(len(steps)) if comm is None else np.nan_to_num(comm, nan=0.0)
    keep = np.isfinite(compute) & np.isfinite(host) & (steps >= steps.min() + WARMUP)
    if not keep.any():
        return {}
    steps, data, compute, host, comm = (a[keep] for a in (steps, data, compute, host, comm))
    own = data + compute + host + comm
    index = steps // width
    order = np.argsort(index, kind="stable")
    index, own, data, compute, host, comm = (
        a[order] for a in (index, own, data, compute, host, comm))
    bounds = np.flatnonzero(np.diff(index)) + 1
    out: dict[int, tuple[float, ...]] = {}
    for chunk in np.split(np.arange(len(index)), bounds):
        if len(chunk) < max(2, width // 2):  # a window mostly missing: not compared
            continue
        out[int(index[chunk[0]])] = tuple(  # type: ignore[assignment]
            float(np.quantile(a[chunk], FLOOR)) for a in (own, data, compute, host, comm)
        )
    return out


def name_stragglers(windows: dict[int, dict[int, tuple[float, ...]]],
                    width: int, threshold: float = THRESHOLD) -> list[dict[str, Any]]:
    """The streaks of :func:`find_stragglers` from every rank's :func:`rank_windows`."""
    all_windows = sorted({w for mine in windows.values() for w in mine})
    streaks: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for w in all_windows:
        here = {r: mine[w] for r, mine in windows.items() if w in mine}
        leader = None
        if len(here) >= 2:
            rank = max(here, key=lambda r: here[r][0])
            # the others' median: with the leader in it, 2 ranks would halve its slowdown
            median = np.median(np.array([v for r, v in here.items() if r != rank]), axis=0)
            if median[0] > 0:
                slowdown = here[rank][0] / median[0] - 1.0
                if slowdown >= threshold:
                    leader = (rank, slowdown, np.array(here[rank][1:]) - median[1:])
        if leader is not None and current is not None and current["rank"] == leader[0] \
                and current["last"] == w - 1:
            current["last"] = w
            current["slowdowns"].append(leader[1])
            current["excess"].append(leader[2])
        else:
            _close(current, streaks, width)
            current = None if leader is None else {
                "rank": leader[0], "first": w, "last": w, "slowdowns": [leader[1]],
                "excess": [leader[2]],
            }
    _close(current, streaks, width)
    streaks.sort(key=lambda s: (-s["slowdown"], s["rank"]))
    return streaks[:MAX_NAMED]


def _close(current: dict[str, Any] | None, streaks: list[dict[str, Any]], width: int) -> None:
    if current is None or len(current["slowdowns"]) < SUSTAIN:
        return
    excess = np.median(np.array(current["excess"]), axis=0)
    streaks.append({
        "rank": current["rank"],
        "cause": CAUSES[int(np.argmax(excess))],
        "slowdown": round(float(np.median(current["slowdowns"])), 4),
        "since_step": current["first"] * width,
        "until_step": (current["last"] + 1) * width - 1,
        "excess_seconds": {c: round(float(x), 6) for c, x in zip(CAUSES, excess, strict=True)},
    })


def describe(straggler: dict[str, Any]) -> str:
    """One line: ``rank 2 was 15.1 % slower than the other ranks' median (cause: compute) from
    step 40 to 299``."""
    stage = straggler.get("stage")
    who = f"stage {stage} (rank {straggler['rank']})" if stage else f"rank {straggler['rank']}"
    peers = "its stage's other ranks'" if stage else "the other ranks'"
    return (f"{who} was {100 * straggler['slowdown']:.1f} % slower than "
            f"{peers} median (cause: {straggler['cause']}) from step "
            f"{straggler['since_step']} to {straggler['until_step']}")


def html_section(stragglers: list[dict[str, Any]] | None) -> str:
    """The report's Stragglers section (empty when the timeline could not be built)."""
    if stragglers is None:
        return ""
    if not stragglers:
        return ('<h2>Stragglers</h2><p id="stragglers" class="ok">No rank held the run back by '
                f"{100 * THRESHOLD:g} % or more.</p>")
    items = "".join(f"<li>{html.escape(describe(s))}</li>" for s in stragglers)
    return f'<h2>Stragglers</h2><ul id="stragglers">{items}</ul>'
