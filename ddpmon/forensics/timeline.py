"""Merge all ranks' forensics into one clock-aligned story: what happened first, and where.

Inputs (all optional, all per rank, under one ``run_dir/<run_id>/``): ``events.rank<R>.jsonl``,
``progress.rank<R>.json`` (last completed step), ``crash.rank<R>.txt`` (faulthandler after a
fatal signal), ``sigterm.rank<R>.txt`` (stacks at SIGTERM), ``evidence/`` bundles and
``flight_recorder/fr_trace_rank_<R>.json`` dumps (or ``flight_recorder.rank<R>.json``, where
older versions put them). Every name comes from :mod:`ddpmon.rundir.layout`.

Alignment: every event's ``t`` is its ``ts`` plus the ``clock_offset_seconds`` of the rank's
latest ``start`` event before it (rank 0's clock). Synthetic events: a crash file becomes a
``signal`` event (timed by the file's mtime), a SIGTERM dump a ``signal`` event for SIGTERM, and
a rank whose log ends without ``exit`` or signal a ``vanished`` event at its last event.

The first failure is chosen by evidence, then time:
0. *origin* failures: a local ``nonfinite`` (``origin`` not false), a ``rerun`` on its origin
   rank (unless it applied the step), a ``replica_mismatch``, a fatal signal, ``oom``, an
   ``exit`` by exception that is not a communication error, an ``exit`` with a non-zero code;
   an exception read as non-finite (:mod:`.exceptions`) after the hooks' evidence, and as a
   consequence on a rank whose own gradients of that step were finite;
1. ``vanished`` ranks (died without a word: SIGKILL, OOM killer, ``os._exit``);
2. ``stall`` events, the rank whose flight recorder shows the fewest enqueued collectives first
   (the rank that stopped issuing them is the hung one; the others wait for it);
3. consequences: reduced-gradient ``nonfinite``, ``overflow``, ``scale_floor``, SIGTERM/SIGINT
   (the launcher tearing down survivors), communication-error exits (after signals: a lost
   peer follows the signal that stopped it), ``thread_exception``.
A ``loss_scale_floor`` event that stopped the run (``action=raise``, or ``source=deepspeed``) is
an origin failure; the overflows its scaler absorbed before it are then consequences.
Within a class the earliest aligned time wins.

Restarts: every event carries its ``attempt`` (:mod:`ddpmon.forensics.attempts`); crash files
belong to the attempt running at their mtime, and a rank's attempt without an exit is
``vanished`` on its own. ``recovery`` adds the attempts, the last good checkpoint before the
first failure and the steps a restart from it loses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..rundir.damage import ReadWarnings, read_json, read_json_lines
from ..rundir.layout import CRASH_RE, EVENTS_RE, PROGRESS_RE, SIGTERM_RE, RunDir, parse_bundle_name
from . import attempts as att
from .crash_files import crash_event, running_step, sigterm_event
from .failure import ending, first_failure, read_exits
from .run_bounds import MAX_WORLD_SIZE, grouped, missing_ranks
from .stragglers import find_stragglers
from .verdict import format_ids, verdict


class RunDirError(Exception):
    """The directory is not a run, or holds no events; the message says what was found, and
    ``damage`` the damaged files that left nothing to read."""

    def __init__(self, message: str, damage: ReadWarnings | None = None) -> None:
        super().__init__(message)
        self.damage = damage if damage is not None else ReadWarnings()


@dataclass(slots=True)
class Timeline:
    run_path: Path
    events: list[dict[str, Any]]
    ranks: dict[int, dict[str, Any]]
    first_failure: dict[str, Any] | None
    world_size: int | None
    missing_ranks: list[int]
    warnings: list[str] = field(default_factory=list)
    recovery: dict[str, Any] = field(default_factory=dict)
    """``attempts`` and, after a failure, ``last_good_checkpoint``, ``steps_lost`` and
    ``restarted`` (see :mod:`ddpmon.forensics.attempts`)."""
    damage: ReadWarnings = field(default_factory=ReadWarnings)
    """Damaged files met (their lines are in ``warnings`` too)."""
    verdict: dict[str, str] | None = None
    """The layer the first failure points at, and the evidence (:mod:`.verdict`)."""
    missing_count: int = 0
    """Ranks of the world size without any file (``missing_ranks`` lists the lowest of them)."""
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    """The ranks that held the run back, slowest first (:mod:`.stragglers`)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "run_path": str(self.run_path),
            "world_size": self.world_size,
            "first_failure": self.first_failure,
            "verdict": self.verdict,
            **self.recovery,
            "ranks": {str(r): v for r, v in sorted(self.ranks.items())},
            "missing_ranks": self.missing_ranks,
            "missing_count": self.missing_count,
            "stragglers": self.stragglers,
            "partial": bool(self.missing_count),
            "warnings": self.warnings,
            "damaged": self.damage.to_json(),
            "events": self.events,
        }


def resolve_run_path(path: Path | str) -> Path:
    """``path`` itself when it holds a run's files, else its only sub-directory that does."""
    path = Path(path)
    if not path.is_dir():
        raise RunDirError(f"{path}: no such directory")
    if RunDir(path).is_run():
        return path
    runs = sorted(p for p in path.iterdir() if p.is_dir() and RunDir(p).is_run())
    if len(runs) == 1:
        return runs[0]
    if runs:
        names = ", ".join(p.name for p in runs)
        raise RunDirError(f"{path} holds several runs ({names}); pass one of them")
    raise RunDirError(
        f"{path}: no ddpmon run here (no events.rank<R>.jsonl, crash.rank<R>.txt or "
        "manifest.json, here or one level down)"
    )


def build_timeline(path: Path | str) -> Timeline:
    """The merged timeline of a run; damaged files are read as far as they go and named in the
    result's ``damage`` (and ``warnings``); one rank's damage never drops another rank.

    Work is linear in what the run dir holds: events are grouped by rank and attempt once, and
    a world size claimed beyond :data:`MAX_WORLD_SIZE` is damage, never a loop bound."""
    run_path = resolve_run_path(path)
    run = RunDir(run_path)
    damage = ReadWarnings(run_path)
    warnings: list[str] = []
    per_rank = _rank_events(run, damage)
    rank_starts = {rank: att.tag_attempts(events) for rank, events in per_rank.items()}
    for rank, events in per_rank.items():
        if n := att.unbegun_claims(events):
            damage.add(run.events(rank), f"{n} event(s) claim an attempt that no start event "
                       "began", "counted in the attempt running")
    ranks, merged, world_size = _aligned(per_rank, warnings, run, damage)
    read_exits(merged)

    # Last completed step per rank: the progress file knows it even for a rank killed mid-run.
    progress: dict[int, dict[str, Any]] = {}
    for rank, f in run.ranked(PROGRESS_RE).items():
        p = read_json(f, damage, kept="its last step not used", check=_progress_problem)
        if p is not None:
            progress[rank] = p
    steps = _LastSteps({rank: att.progress_by_attempt(rank_starts.get(rank, []), progress.get(rank))
                        for rank in set(per_rank) | set(progress)})

    merged.extend(_dump_events(run, damage, ranks, rank_starts, per_rank, steps))
    merged.extend(_vanished_ranks(ranks, merged, steps, run))
    merged.sort(key=lambda e: (e["t"], e.get("rank", 0)))
    t0 = merged[0]["t"] if merged else 0.0
    for e in merged:
        e["t_rel"] = round(e["t"] - t0, 6)

    fr_status = _flight_recorder(run, damage)
    by_rank = grouped(merged, "rank")
    _summarize_ranks(run, ranks, by_rank, progress, fr_status, steps)

    missing, missing_count = missing_ranks(world_size, ranks)
    if missing_count:
        warnings.append(f"partial run: no files from rank(s) {format_ids(missing, missing_count)}"
                        f" of {world_size}")
    if not merged:
        if damage.items:
            raise RunDirError(f"{run_path}: no readable events: " + "; ".join(damage.lines()),
                              damage)
        raise RunDirError(f"{run_path}: the run has no events yet (empty event logs)")

    first = first_failure(merged, fr_status)
    last_steps = {
        (rank, a): steps.last(rank, mine, a)
        for rank in ranks
        for a, mine in sorted(grouped(by_rank.get(rank, []), "attempt").items())
    }
    recovery = att.summarize(merged, first, last_steps)
    stragglers = find_stragglers(run, damage)
    warnings = damage.lines() + warnings
    return Timeline(run_path, merged, ranks, first, world_size, missing, warnings, recovery,
                    damage, verdict(first, merged), missing_count, stragglers)


def _rank_events(run: RunDir, damage: ReadWarnings) -> dict[int, list[dict[str, Any]]]:
    """Every rank's readable events; an empty log beside others that have events is damage."""
    per_rank: dict[int, list[dict[str, Any]]] = {}
    for rank, f in run.ranked(EVENTS_RE).items():
        per_rank[rank] = [_event(e, rank) for e in read_json_lines(f, damage, valid=_is_event)]
    if any(per_rank.values()):  # an empty log beside others that have events lost its lines
        for rank, f in run.ranked(EVENTS_RE).items():
            if not per_rank[rank] and damage.name(f) not in damage.files():
                damage.add(f, "empty", f"no events from rank {rank}")
    return per_rank


def _aligned(per_rank: dict[int, list[dict[str, Any]]], warnings: list[str], run: RunDir,
             damage: ReadWarnings
             ) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]], int | None]:
    """Every event on rank 0's clock (``t``: its ``ts`` plus the offset its attempt's start
    event measured), each rank's clock facts, and the world size the starts name (a claim
    over :data:`MAX_WORLD_SIZE` is damage of that rank's log, and not used)."""
    ranks: dict[int, dict[str, Any]] = {}
    merged: list[dict[str, Any]] = []
    world_size: int | None = None
    for rank, events in per_rank.items():
        offset, rtt = 0.0, None
        starts = [e for e in events if e.get("kind") == "start"]
        if starts:
            offset = _num(starts[0].get("clock_offset_seconds"), 0.0)
        else:
            warnings.append(f"rank {rank}: no start event; its clock is not aligned")
        for e in events:
            if e.get("kind") == "start":
                offset = _num(e.get("clock_offset_seconds"), 0.0)
                rtt = e.get("clock_rtt_seconds", rtt)
                ws = e.get("world_size")
                if _is_int(ws) and ws > MAX_WORLD_SIZE:
                    damage.add(run.events(rank), f"a start event claims world_size {ws}, over "
                               f"the {MAX_WORLD_SIZE} a reader takes", "claim not used")
                elif _is_int(ws) and ws > 0:
                    world_size = max(world_size or 0, ws)
            e["rank"] = e.get("rank", rank)
            e["t"] = _num(e.get("ts"), 0.0) + offset
        ranks[rank] = {"events": len(events), "clock_offset_seconds": offset,
                       "clock_rtt_seconds": rtt}
        merged.extend(events)
    return ranks, merged, world_size


class _LastSteps:
    """The last completed step of a rank in an attempt, from its events and its progress."""

    def __init__(self, by_attempt: dict[int, dict[int, dict[str, Any]]]) -> None:
        self.by_attempt = by_attempt

    def last(self, rank: int, events: list[dict[str, Any]], attempt: int | None = None
             ) -> int | None:
        """Last completed step index of ``rank`` in ``attempt`` (default: its newest)."""
        if attempt is None:
            attempt = max((e["attempt"] for e in events if "attempt" in e), default=0)
        # a signal's step is the one that was running, not a completed one; a step that was
        # running (a dump's live line, the step in flight an exit or its non-finite event
        # names) says the one before it completed, which the progress
        # file, written every 50 ms, may not have reached when the process died
        ours = [e for e in events if e.get("attempt", 0) == attempt]
        mine = [e for e in ours if e.get("kind") not in (att.SAVE, att.LOAD, "signal")
                and e.get("running") is not True]
        kept = self.by_attempt.get(rank, {}).get(attempt, {}).get("step")
        before = [e["step"] - 1 for e in ours
                  if e.get("running") is True and isinstance(e.get("step"), int)]
        steps = [s for s in (_last_step(mine), kept, *before) if isinstance(s, int) and s >= 0]
        return max(steps) if steps else None


def _dump_events(run: RunDir, damage: ReadWarnings, ranks: dict[int, dict[str, Any]],
                 rank_starts: dict, per_rank: dict[int, list[dict[str, Any]]],
                 steps: _LastSteps) -> list[dict[str, Any]]:
    """``signal`` events from the crash and SIGTERM dumps, on rank 0's clock, each at the step
    that was running (the dump's live line) or else the rank's last completed one."""
    synthetic: list[dict[str, Any]] = []
    for regex, parser in ((CRASH_RE, crash_event), (SIGTERM_RE, sigterm_event)):
        for rank, f in run.ranked(regex).items():
            ev = parser(f, rank, damage)
            if ev is None:
                continue
            offset = ranks.get(rank, {}).get("clock_offset_seconds", 0.0)
            ev["t"] = ev["ts"] + offset
            ev["attempt"] = att.attempt_at(rank_starts.get(rank, []), ev["ts"])
            live = ev.pop("live_step", None)
            ev["step"] = live if isinstance(live, int) else steps.last(
                rank, per_rank.get(rank, []), ev["attempt"])
            if isinstance(live, int):
                ev["running"] = True
            synthetic.append(ev)
            ranks.setdefault(rank, {"events": 0, "clock_offset_seconds": offset,
                                    "clock_rtt_seconds": None})
    return synthetic


def _vanished_ranks(ranks: dict[int, dict[str, Any]], merged: list[dict[str, Any]],
                    steps: _LastSteps, run: RunDir) -> list[dict[str, Any]]:
    """Ranks (per attempt) that ended without an exit event or a signal: killed from outside,
    or still running; the newest attempt's at the step its crash file's live line says was in
    progress (else its last completed step)."""
    found = []
    by_rank = grouped(merged, "rank")
    crash_files = run.ranked(CRASH_RE)
    for rank in ranks:
        by_attempt = grouped(by_rank.get(rank, []), "attempt")
        newest = max(by_attempt, default=None)
        for attempt, mine in sorted(by_attempt.items()):
            vanished = _vanished(rank, attempt, mine, steps.by_attempt.get(rank, {}).get(
                attempt, {}), ranks[rank]["clock_offset_seconds"])
            if vanished is None:
                continue
            vanished["step"] = steps.last(rank, mine, attempt)
            live = (running_step(crash_files[rank])
                    if rank in crash_files and attempt == newest else None)
            if live is not None and live["step"] >= (vanished["step"] or 0):
                vanished.update(step=live["step"], phase=live["phase"], running=True)
            found.append(vanished)
    return found


def _summarize_ranks(run: RunDir, ranks: dict[int, dict[str, Any]],
                     by_rank: dict[int, list[dict[str, Any]]], progress: dict[int, dict[str, Any]],
                     fr_status: dict, steps: _LastSteps) -> None:
    """Each rank's last event and step, how it ended, its attempts, evidence and dumps."""
    evidence: dict[int, list[str]] = {}
    for b in run.bundles():
        parsed = parse_bundle_name(b.name)
        if parsed:
            evidence.setdefault(parsed[0], []).append(str(b.relative_to(run.path)))
    for rank, info in ranks.items():
        mine = by_rank.get(rank, [])
        meaningful = [e for e in mine if e.get("kind") != "vanished"]
        last = meaningful[-1] if meaningful else None
        info["last_event"] = _brief(last) if last else None
        info["last_step"] = steps.last(rank, mine)
        if rank in progress:
            info["progress"] = progress[rank]
        newest = max((e.get("attempt", 0) for e in mine), default=0)
        info["ended"] = ending([e for e in mine if e.get("attempt", 0) == newest])
        info["attempts"] = newest + 1
        info["evidence"] = evidence.get(rank, [])
        if rank in fr_status:
            info["flight_recorder"] = fr_status[rank]


def _is_event(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("kind"), str)


def _event(e: dict[str, Any], rank: int) -> dict[str, Any]:
    """An event whose fields the timeline relies on have usable types (a wrong-typed ``rank``
    or ``step`` from a damaged line is replaced, never trusted)."""
    if not _is_int(e.get("rank")):
        e["rank"] = rank
    if e.get("step") is not None and not _is_int(e["step"]):
        e["step"] = None
    if e.get("attempt") is not None and not isinstance(e["attempt"], int):
        del e["attempt"]
    return e


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _progress_problem(p: dict[str, Any]) -> str | None:
    step = p.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return f"no integer step (step={str(step)[:40]!r})"
    return None


def _vanished(rank: int, attempt: int, mine: list[dict[str, Any]], progress: dict[str, Any],
              offset: float) -> dict[str, Any] | None:
    """A synthetic ``vanished`` event for one rank's attempt that has no exit or signal."""
    if not mine or any(e.get("kind") in ("exit", "signal") for e in mine):
        return None
    last = max(mine, key=lambda e: e["t"])
    if last.get("kind") == "stall":
        return None  # hung (or killed while hung): the stall event is the better story
    ts, t = last.get("ts"), last["t"]
    p_ts = _num(progress.get("ts"), 0.0)
    if p_ts > _num(ts, 0.0):  # it completed steps after its last event
        ts, t = p_ts, p_ts + offset
    return {
        "ts": ts, "t": t, "rank": rank, "step": None, "attempt": attempt,
        "kind": "vanished", "synthetic": True,
        "detail": f"no exit event or signal after its last event ({last.get('kind')}): "
                  "killed from outside (SIGKILL, OOM killer), os._exit, or still running",
    }


def _brief(e: dict[str, Any]) -> dict[str, Any]:
    skip = {"traceback", "stacks", "records"}
    return {k: v for k, v in e.items() if k not in skip}


def _flight_recorder(run: RunDir, damage: ReadWarnings) -> dict[int, dict[str, Any]]:
    """Default-group status of each rank's JSON flight-recorder dump, in the current layout
    (``flight_recorder/fr_trace_rank_<R>.json``) or the legacy one
    (``flight_recorder.rank<R>.json``)."""
    out: dict[int, dict[str, Any]] = {}
    for rank, f in run.flight_recorder_dumps().items():
        data = read_json(f, damage, kept="its collective counts not used")
        status = data.get("pg_status") if data is not None else None
        if data is not None and not isinstance(status, dict):
            damage.add(f, "no pg_status object", "its collective counts not used")
        if not isinstance(status, dict) or not status:
            continue
        default = status.get("0") or next(iter(status.values()))
        if isinstance(default, dict):
            out[rank] = {k: _maybe_int(v) for k, v in default.items()}
    return out


def _maybe_int(v: Any) -> Any:
    try:
        return int(v)
    except (TypeError, ValueError):
        return v


def _last_step(events: list[dict[str, Any]]) -> int | None:
    steps = [e["step"] for e in events if isinstance(e.get("step"), int)]
    return max(steps) if steps else None


def _num(v: Any, default: float) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return default
    return f if f == f and abs(f) != float("inf") else default


def describe(e: dict[str, Any]) -> str:
    """A short human description of an event's fields."""
    kind = e.get("kind")
    parts: list[str] = []
    if kind == "signal":
        parts.append(f"{e.get('signal')}" + (f" ({e.get('signum')})" if e.get("signum") else ""))
    elif str(kind).startswith("loss_spike"):  # agent.spikes: what spiked, then the group
        parts.append(f"signal={e.get('signal')}")
    for key in ("param", "tensor", "nonfinite", "origin", "stage", "microbatch", "site", "where",
                "action", "exc_type", "cause", "message", "code", "reason", "idle_seconds",
                "loss_scale", "floor", "phase", "frame", "detail", "seconds", "not_restored",
                "not_stated", "error", "path", "value", "baseline", "detected_step", "group",
                "group_signal", "group_step", "group_factor", "sample_ids", "recovered_step"):
        v = e.get(key)
        if v is None or v == "":
            continue
        if key == "message":
            v = str(v).splitlines()[0][:120] if str(v) else v
        if isinstance(v, list):
            if not v:
                continue
            more = f",...(+{len(v) - 8})" if key == "sample_ids" and len(v) > 8 else ""
            v = ",".join(map(str, v[:8] if more else v)) + more
        if isinstance(v, float):
            v = f"{v:.3g}"
        parts.append(f"{key}={v}")
    return " ".join(parts)
