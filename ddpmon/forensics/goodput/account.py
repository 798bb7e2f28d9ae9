"""Where a job's wall-clock time went, post hoc, from its run dir: the merged timeline (events on
rank 0's clock, attempts, checkpoints, exits) and every step row of every rank.

Per rank, the window from the job's first process start to its end (or ``now``) is painted
(:mod:`.paint`): each step row gives a data wait and a step; a step is *lost* when a later
attempt resumed from a checkpoint older than it (a later attempt's first step: its
``checkpoint_load`` event's ``resume_step``, else its first step row); the first steps of an
attempt that ran over 1.5x the rank's median step time give the excess to warm-up; checkpoint
saves/loads and marked phases come from events. Time no interval covers is initialisation
(process start to the first step), failure detection (a failed attempt's last completed step to
the attempt's last event on any rank), restart gap (to the next attempt's process start) or
other. The job's figure is the mean over ranks (each rank's buckets add up to the same window,
so the mean does too).

A rank killed with SIGKILL loses its last unjournaled history rows (up to ``flush_seconds``);
its progress file still names the last completed step and when, and the other ranks' rows name
the last step the job completed, which every rank computed (the ranks step together): the
missing steps take the other ranks' times for them, else share the time evenly, each a median
data wait then a step, and the result says so in ``estimated``."""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from ..failure import ending
from ..run_bounds import grouped
from . import buckets as B
from .paint import Span, paint
from .rows import StepRow

WARMUP_FACTOR = 1.5
"""A step slower than this times the median step time, among an attempt's first steps, is
warm-up (compilation, allocator and cache warm-up)."""
WARMUP_MAX_STEPS = 50
"""Warm-up is looked for in at most this many first steps of an attempt."""
GOOD_ENDINGS = ("closed (mon.close)", "exit code 0")
MAX_TIME = 1e11
"""Times (and spans) beyond this many seconds are no clock's (the year 5138): not used."""


@dataclass(slots=True)
class Goodput:
    wall_seconds: float
    buckets: dict[str, float]
    """Bucket -> seconds (mean over ranks); they add up to ``wall_seconds``."""
    attempts: list[dict[str, Any]]
    """Per attempt: ``attempt``, ``t_rel_start``, ``t_rel_end``, ``buckets``."""
    ranks: dict[int, dict[str, Any]]
    """Per rank: ``buckets``, ``steady_step_seconds``, ``kept_steps``, ``lost_steps``."""
    start_t: float
    end_t: float
    t0: float
    """The timeline's origin (its ``t_rel`` 0)."""
    estimated: list[str] = field(default_factory=list)
    """Lines saying which times were estimated, and why."""

    @property
    def goodput(self) -> float | None:
        return self.buckets[B.PRODUCTIVE] / self.wall_seconds if self.wall_seconds > 0 else None

    @property
    def ettr(self) -> float | None:
        if self.wall_seconds <= 0:
            return None
        kept = sum(v for k, v in self.buckets.items() if B.BY_NAME[k].ettr_productive)
        return kept / self.wall_seconds

    def to_json(self) -> dict[str, Any]:
        def rounded(d: dict[str, float]) -> dict[str, float]:
            return {k: round(v, 6) for k, v in d.items()}

        return {
            "wall_seconds": round(self.wall_seconds, 6),
            "t_rel_start": round(self.start_t - self.t0, 6),
            "t_rel_end": round(self.end_t - self.t0, 6),
            "goodput": _ratio(self.goodput),
            "ettr": _ratio(self.ettr),
            "buckets": rounded(self.buckets),
            "attempts": [{**a, "buckets": rounded(a["buckets"])} for a in self.attempts],
            "ranks": {str(r): {**v, "buckets": rounded(v["buckets"])}
                      for r, v in sorted(self.ranks.items())},
            "estimated": self.estimated,
        }


def account(events: list[dict[str, Any]], attempts: list[dict[str, Any]],
            rows: dict[int, list[StepRow]], progress: dict[int, dict[str, Any]] | None = None,
            now: float | None = None) -> Goodput | None:
    """The job's goodput from the merged, attempt-tagged events (``t`` on rank 0's clock), the
    timeline's ``attempts`` and each rank's step rows; None when no rank has a start event.
    ``progress``: each rank's progress file (its newest attempt's last step); ``now``: a live
    run's present (rank 0's clock), else the run ends at its last event or step."""
    events = [e for e in events if isinstance(e.get("t"), float | int)
              and math.isfinite(e["t"]) and abs(e["t"]) < MAX_TIME]
    starts = _starts(events)
    if not starts:
        return None
    ends = _attempt_ends(events)
    failed = _failed_attempts(events)
    t0 = min(e["t"] for e in events)
    start = min(s["p"] for per in starts.values() for s in per)
    placed = {r: _place_rows(rows.get(r, []), starts[r]) for r in starts}
    last_row = max((r.end + off for per in placed.values() for a in per.values()
                    for r, off in a), default=start)
    end = now if now is not None else max(max(ends.values()), last_row)
    if not (math.isfinite(end - start) and 0 <= end - start < MAX_TIME):
        return None  # times no clock gives (damage): no figure rather than a wrong one
    first_steps = _resume_steps(attempts, placed)
    numbers = sorted({s["attempt"] for per in starts.values() for s in per})
    lost_from = {a: min((first_steps.get(b, 0) for b in numbers if b > a), default=None)
                 for a in numbers}
    job_starts = {a: min(s["p"] for per in starts.values() for s in per if s["attempt"] == a)
                  for a in numbers}
    job_starts[numbers[0]] = start
    peers = _peer_steps(placed)
    estimated: list[str] = []
    per_rank: dict[int, dict[str, Any]] = {}
    per_attempt: dict[int, dict[str, float]] = {a: dict.fromkeys(B.NAMES, 0.0) for a in numbers}
    final = numbers[-1]
    for rank, mine in sorted(starts.items()):
        prog = _progress_by_attempt(mine, (progress or {}).get(rank))
        rank_rows = placed[rank]
        durations = [r.duration for a in rank_rows.values() for r, _ in a]
        steady = statistics.median(durations) if durations else 0.0
        waits = [r.data_wait for a in rank_rows.values() for r, _ in a]
        wait = statistics.median(waits) if waits else 0.0
        spans: list[Span] = []
        shape: dict[int, tuple[float, float]] = {}
        kept = lost = 0
        for s in mine:
            a = s["attempt"]
            got = _attempt_spans(rank_rows.get(a, []), prog.get(a), s["offset"], steady,
                                 wait, lost_from.get(a), first_steps.get(a), peers.get(a, {}))
            spans.extend(got.spans)
            kept, lost = kept + got.kept, lost + got.lost
            if got.estimated:
                estimated.append(f"rank {rank} attempt {a}: {got.estimated} step(s) after its "
                                 f"last history row, counted from {got.witness} (history rows "
                                 "lost, e.g. to a SIGKILL)")
            shape[a] = (got.first_start if got.first_start is not None else end,
                        got.last_end if got.last_end is not None else s["p"])
        spans.extend(_event_spans(events, rank))
        ps = [s["p"] for s in mine]
        nums = [s["attempt"] for s in mine]

        def fill(t: float, ps=ps, nums=nums, shape=shape) -> str:
            i = bisect.bisect_right(ps, t) - 1
            if i < 0:
                return B.INIT
            a = nums[i]
            first, last = shape[a]
            if t < first:
                return B.INIT
            if t <= last:
                return B.OTHER
            if a == final or t <= ends.get(a, last):
                return B.DETECT if a in failed else B.OTHER
            return B.GAP

        cuts = [*ps, *job_starts.values(), *(v for pair in shape.values() for v in pair),
                *ends.values()]
        segments = paint(spans, start, end, fill, cuts)
        totals = dict.fromkeys(B.NAMES, 0.0)
        bounds = sorted(job_starts.items(), key=lambda kv: kv[1])
        keys = [t for _, t in bounds]
        for seg in segments:
            width = seg.end - seg.start
            totals[seg.bucket] += width
            i = max(bisect.bisect_right(keys, (seg.start + seg.end) / 2) - 1, 0)
            per_attempt[bounds[i][0]][seg.bucket] += width
        per_rank[rank] = {"buckets": totals, "steady_step_seconds": round(steady, 6),
                          "kept_steps": kept, "lost_steps": lost}
    n = len(per_rank)
    job = {k: sum(v["buckets"][k] for v in per_rank.values()) / n for k in B.NAMES}
    bounds = sorted(job_starts.items(), key=lambda kv: kv[1])
    out_attempts = []
    for i, (a, t) in enumerate(bounds):
        t_end = bounds[i + 1][1] if i + 1 < len(bounds) else end
        out_attempts.append({"attempt": a, "t_rel_start": round(t - t0, 6),
                             "t_rel_end": round(t_end - t0, 6),
                             "buckets": {k: v / n for k, v in per_attempt[a].items()}})
    return Goodput(end - start, job, out_attempts, per_rank, start, end, t0, estimated)


@dataclass(slots=True)
class _Painted:
    spans: list[Span]
    kept: int = 0
    lost: int = 0
    estimated: int = 0
    witness: str = ""
    """What said the ``estimated`` steps completed: the progress file or the other ranks."""
    first_start: float | None = None
    last_end: float | None = None


def _attempt_spans(rows: list[tuple[StepRow, float]], progress: dict[str, Any] | None,
                   offset: float, steady: float, wait: float, lost_from: int | None,
                   resume: int | None, peers: dict[int, tuple[float, float, float]]
                   ) -> _Painted:
    """One rank's attempt: data wait, warm-up, productive or lost spans of each step row, and
    the steps after its last row that its progress file says completed: timed as the same step
    on the other ranks (``peers``: step -> median end, step time and wait), else sharing the
    time to the progress file's evenly."""
    out = _Painted([])
    warming = True
    for i, (row, off) in enumerate(rows):
        end = row.end + off
        begin = end - row.duration
        if row.data_wait > 0:
            out.spans.append(Span(begin - row.data_wait, begin, B.DATA))
        excess = row.duration - steady
        warm = warming and i < WARMUP_MAX_STEPS and steady > 0 and (
            row.duration > WARMUP_FACTOR * steady)
        warming = warm
        is_lost = lost_from is not None and row.step >= lost_from
        if is_lost:
            out.spans.append(Span(begin, end, B.LOST))
        elif warm:
            out.spans.append(Span(begin, begin + excess, B.WARMUP))
            out.spans.append(Span(begin + excess, end, B.PRODUCTIVE))
        else:
            out.spans.append(Span(begin, end, B.PRODUCTIVE))
        out.lost += is_lost
        out.kept += not is_lost
        out.first_start = begin if out.first_start is None else min(out.first_start, begin)
        out.last_end = end if out.last_end is None else max(out.last_end, end)
    last_step = rows[-1][0].step if rows else (resume - 1 if resume is not None else None)
    if last_step is None or steady <= 0:
        return out
    p_step, p_end = (progress or {}).get("step"), _num((progress or {}).get("ts"))
    witness = "its progress file"
    if not isinstance(p_step, int) or p_end is None:
        p_step = p_end = None
    else:
        p_end += offset
    peer_last = max(peers) if peers else None
    if peer_last is not None and (p_step is None or peer_last > p_step):
        # the ranks step together: a step completed on the others was computed here too (a
        # SIGKILL can take a rank's last step before its record thread wrote row or progress)
        p_step, p_end = peer_last, peers[peer_last][0]
        witness = "the other ranks' rows"
    if p_step is None or p_step <= last_step:
        return out
    missing = p_step - last_step
    t = out.last_end
    if t is None:  # no row at all: from where the first missing step began on the peers
        first = peers.get(last_step + 1)
        t = first[0] - first[1] - first[2] if first else p_end - missing * steady
    if p_end <= t:
        return out
    width = (p_end - t) / missing
    for k in range(missing):
        step = last_step + 1 + k
        end = t + width * (k + 1)
        dur = max(width - wait, min(steady, width))
        begin = end - width
        twin = peers.get(step)
        if twin is not None:  # the same step on the ranks that kept its row
            end, dur, wait_k = twin
            end = min(max(end, t), p_end)
            begin, dur = end - dur - wait_k, min(dur, end - t)
        if end - dur > begin:
            out.spans.append(Span(max(begin, t), end - dur, B.DATA))
        is_lost = lost_from is not None and step >= lost_from
        out.spans.append(Span(end - dur, end, B.LOST if is_lost else B.PRODUCTIVE))
        out.lost += is_lost
        out.kept += not is_lost
        if out.first_start is None:
            out.first_start = end - dur
    out.last_end = p_end
    out.estimated, out.witness = missing, witness
    return out


def _peer_steps(placed: dict[int, dict[int, list[tuple[StepRow, float]]]]
                ) -> dict[int, dict[int, tuple[float, float, float]]]:
    """attempt -> step -> the median end (rank 0's clock), step time and data wait of that step
    over the ranks whose history holds it."""
    seen: dict[int, dict[int, list[tuple[float, float, float]]]] = {}
    for per in placed.values():
        for a, rows in per.items():
            for row, off in rows:
                seen.setdefault(a, {}).setdefault(row.step, []).append(
                    (row.end + off, row.duration, row.data_wait))
    return {a: {step: tuple(statistics.median(x[i] for x in v) for i in range(3))
                for step, v in steps.items()} for a, steps in seen.items()}


def _event_spans(events: list[dict[str, Any]], rank: int) -> list[Span]:
    """Checkpoint saves/loads and marked phases of one rank: each event ends at its ``t`` and
    lasted ``seconds`` (the window clips a claim longer than the run)."""
    kinds = {"checkpoint_save": B.SAVE, "checkpoint_load": B.RESTORE, "phase": B.CUSTOM}
    out = []
    for e in events:
        bucket = kinds.get(e.get("kind"))
        secs = _num(e.get("seconds"))
        if bucket and e.get("rank") == rank and secs is not None and secs > 0:
            out.append(Span(e["t"] - secs, e["t"], bucket))
    return out


def _starts(events: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """rank -> its start events as ``attempt``, ``ts`` (its clock), ``offset`` and ``p`` (the
    process start on rank 0's clock; the start event's time when it was not recorded)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("kind") != "start" or e.get("synthetic"):
            continue
        offset = _num(e.get("clock_offset_seconds")) or 0.0
        born = _num(e.get("process_start_ts"))
        p = born + offset if born is not None and e["t"] - 86400 <= born + offset <= e["t"] \
            else e["t"]
        out.setdefault(e["rank"], []).append({"attempt": e["attempt"], "ts": e["t"] - offset,
                                              "offset": offset, "p": p,
                                              "previous": e.get("previous_progress")})
    for per in out.values():
        per.sort(key=lambda s: s["p"])
    return out


def _place_rows(rows: list[StepRow], starts: list[dict[str, Any]]
                ) -> dict[int, list[tuple[StepRow, float]]]:
    """attempt -> its rows (by end time, this rank's clock) with that attempt's clock offset."""
    out: dict[int, list[tuple[StepRow, float]]] = {}
    ts = [s["ts"] for s in starts]
    for row in rows:
        i = max(bisect.bisect_right(ts, row.end) - 1, 0)
        out.setdefault(starts[i]["attempt"], []).append((row, starts[i]["offset"]))
    return out


def _resume_steps(attempts: list[dict[str, Any]], placed: dict) -> dict[int, int]:
    """attempt -> the first step it computed: its checkpoint load's resume step, else the
    lowest step of its rows on any rank, else 0 (a fresh start)."""
    out: dict[int, int] = {}
    for a in attempts:
        resumed = a.get("resumed_from") or {}
        if isinstance(resumed.get("step"), int):
            out[a["attempt"]] = resumed["step"]
    lows: dict[int, int] = {}
    for per in placed.values():
        for a, rows in per.items():
            if rows:
                low = min(r.step for r, _ in rows)
                lows[a] = min(lows.get(a, low), low)
    return {**lows, **out}


def _attempt_ends(events: list[dict[str, Any]]) -> dict[int, float]:
    out: dict[int, float] = {}
    for e in events:
        a = e.get("attempt", 0)
        out[a] = max(out.get(a, e["t"]), e["t"])
    return out


def _failed_attempts(events: list[dict[str, Any]]) -> set[int]:
    """Attempts in which a rank ended otherwise than well (a signal, an exception, a non-zero
    exit, vanished, or stalled with no exit after)."""

    failed = set()
    for mine in grouped(events, "rank").values():
        for a, theirs in grouped(mine, "attempt").items():
            if ending(theirs) not in GOOD_ENDINGS:
                failed.add(a)
    return failed


def _progress_by_attempt(mine: list[dict[str, Any]], newest: dict[str, Any] | None
                         ) -> dict[int, dict[str, Any]]:
    """attempt -> its last completed step and when: the next start event's
    ``previous_progress`` for earlier attempts, the progress file for the newest."""
    out = {before["attempt"]: s["previous"] for before, s in zip(mine, mine[1:], strict=False)
           if isinstance(s.get("previous"), dict)}
    return out if newest is None else {**out, mine[-1]["attempt"]: newest}


def _ratio(v: float | None) -> float | None:
    return None if v is None else round(v, 6)


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if f == f and abs(f) != float("inf") else None
