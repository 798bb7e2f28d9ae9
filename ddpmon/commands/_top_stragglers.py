"""``ddpmon top``'s straggler column: each rank's slowdown against the other ranks' median and its
cause, from the ranks' step parts (the same comparison as ``ddpmon.mixin.stragglers``' rules,
over what ``top`` scraped: since the previous refresh, or since start on the first).

A rank's own time per step is its step time and data wait less its wait inside collectives
(``ddpmon_step_part_seconds_total{part="wait"}``); its slowdown is that over the median of the
*other* ranks' (with itself in the median, a 2-rank run's straggler would show half its
slowdown), less one; its cause, where the slowdown reaches :data:`THRESHOLD`, is the part (data,
compute, host, communication) furthest above the others' median. Under pipeline parallel a
rank is compared with the ranks of its stage (:func:`peer_groups`), and named with it.
"""

from __future__ import annotations

from .. import metrics
from ..export.scrape import stage_of
from ..terminal import shown

THRESHOLD = 0.05
"""The slowdown from which a cause is named (the shipped alert's ``straggler_slowdown``)."""
CAUSES = ("data", "compute", "host", "communication")
_PART = metrics.STEP_PART_SECONDS.name


def _totals(m: dict) -> tuple[float, ...] | None:
    """``(steps, step seconds, data seconds, data waits, compute, wait, communication)`` since
    start (communication 0 from an agent that does not export it)."""
    step, data = metrics.STEP_DURATION, metrics.DATA_WAIT
    keys = (step.sample("count"), step.sample("sum"), data.sample("sum"), data.sample("count"),
            f'{_PART}{{part="compute"}}', f'{_PART}{{part="wait"}}')
    values = tuple(m.get(k) for k in keys)
    if any(not isinstance(v, float | int) for v in values):
        return None
    comm = m.get(f'{_PART}{{part="communication"}}', 0.0)
    return (*values, comm if isinstance(comm, float | int) else 0.0)


def own_per_step(m: dict, prev: dict | None) -> dict[str, float] | None:
    """Own seconds per step, in all and by cause, over the steps since ``prev`` (when it has
    fewer steps than ``m``), else since start; None without step parts or steps."""
    now = _totals(m)
    if now is None:
        return None
    before = _totals(prev) if prev else None
    grew = before is not None and all(a >= b for a, b in zip(now, before, strict=True))
    if before is not None and grew and now[0] > before[0]:
        now = tuple(a - b for a, b in zip(now, before, strict=True))
    steps, step_s, data_s, data_n, compute, wait, comm = now
    if steps <= 0:
        return None
    data = data_s / data_n if data_n > 0 else 0.0
    host = max(step_s - compute - wait - comm, 0.0) / steps
    own = max(step_s + data_s - wait, 0.0) / steps
    return {"own": own, "data": data, "compute": compute / steps, "host": host,
            "communication": comm / steps}


def _medians_of_others(values: dict[str, float]) -> dict[str, float]:
    """``target -> median of every other target's value``, from one sort (O(n log n), so
    16,384 ranks stay cheap): without the element at sorted position ``i``, the k-th of the
    rest is ``ordered[k]`` below ``i`` and ``ordered[k + 1]`` from it."""
    ordered = sorted(values.items(), key=lambda item: item[1])
    rest = len(ordered) - 1

    def kth(k: int, i: int) -> float:
        return ordered[k if k < i else k + 1][1]

    out = {}
    for i, (target, _) in enumerate(ordered):
        mid = rest // 2
        out[target] = kth(mid, i) if rest % 2 else (kth(mid - 1, i) + kth(mid, i)) / 2
    return out


def peer_groups(stages: dict[str, str | None]) -> list[list[str]]:
    """The targets compared with each other: under pipeline parallel the ranks of each stage
    (a stage heavier by design is not a straggler, and its bubble is wait), when every rank has
    a stage and every stage 2 ranks or more; else the whole run (as ``forensics.stragglers``)."""
    by_stage: dict[str | None, list[str]] = {}
    for target, stage in stages.items():
        by_stage.setdefault(stage, []).append(target)
    if None in by_stage or any(len(g) < 2 for g in by_stage.values()):
        return [list(stages)]
    return list(by_stage.values())


def straggler_scores(results: dict[str, dict | None], previous: dict[str, dict]
                     ) -> dict[str, dict]:
    """``target -> {"slowdown", "cause"}`` for every rank with step parts (``cause`` None
    under the threshold; ``stage`` too where ranks are compared within their pipeline stage);
    empty with fewer than two such ranks."""
    own = {t: o for t, m in results.items() if m is not None
           and (o := own_per_step(m, previous.get(t))) is not None}
    if len(own) < 2:
        return {}
    groups = peer_groups({t: stage_of(results[t] or {}) for t in own})
    out = {}
    for targets in groups:
        mine = {t: own[t] for t in targets}
        if len(mine) < 2:
            continue
        # the others' median: one that held this rank would halve its slowdown with 2 ranks
        others = {k: _medians_of_others({t: o[k] for t, o in mine.items()})
                  for k in ("own", *CAUSES)}
        for target, o in mine.items():
            median = {k: others[k][target] for k in others}
            if median["own"] <= 0:
                continue
            slowdown = o["own"] / median["own"] - 1.0
            cause = None
            if slowdown >= THRESHOLD:
                cause = max(CAUSES, key=lambda c: o[c] - median[c])
            out[target] = {"slowdown": round(slowdown, 4), "cause": cause}
            if (stage := stage_of(results[target] or {})) is not None:
                out[target]["stage"] = stage
    return out


def cell(score: dict | None) -> str:
    """``+15.2% compute``, ``+15.2% compute, stage 1`` (a pipeline stage's rank, against its
    stage), ``+0.3%`` under the threshold, ``-`` without step parts."""
    if score is None:
        return "-"
    text = f"{100 * score['slowdown']:+.1f}%"
    if not score["cause"]:
        return text
    stage = f", stage {shown(score['stage'])}" if score.get("stage") else ""
    return f"[bold red]{text} {score['cause']}{stage}[/]"
