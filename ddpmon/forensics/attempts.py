"""Restart attempts and checkpoints in a run's events: which attempt each event belongs to, what
each attempt resumed from, the last good checkpoint before the first failure and the steps a
restart from it loses.

A torchelastic restart reuses the run id, so every attempt appends to the same
``events.rank<R>.jsonl``. The agent writes ``attempt`` into every event and the ``start`` event;
events without it (older runs, crash capture's own lines) belong to the attempt whose ``start``
came last before them in the file. A progress file holds only the newest attempt's last step;
the earlier attempt's last step is in the next ``start`` event (``previous_progress``).

Checkpoint steps count the steps a checkpoint holds (the step a resume starts at), while event
steps are step indices; so a rank whose last completed step index is 34 has done 35 steps, and
a restart from checkpoint 30 loses 5.
"""

from __future__ import annotations

from typing import Any

SAVE, LOAD = "checkpoint_save", "checkpoint_load"


def tag_attempts(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Give every event of one rank (in file order) an ``attempt``; return its start events.

    An attempt exists when a start event began it: an event that claims an attempt no start
    event before it began is counted in the attempt running (see :func:`unbegun_claims`), so
    the attempts are bounded by the starts the log holds, never by what one line claims."""
    starts: list[dict[str, Any]] = []
    begun: set[int] = set()
    current = 0
    for e in events:
        if e.get("kind") == "start":
            given = e.get("attempt")
            current = given if isinstance(given, int) and given >= 0 else (
                current + 1 if starts else 0)
            e["attempt"] = current
            begun.add(current)
            starts.append(e)
        elif not isinstance(e.get("attempt"), int):
            e["attempt"] = current
        elif e["attempt"] not in begun:
            e[UNBEGUN] = e["attempt"]
            e["attempt"] = current
    return starts


UNBEGUN = "attempt_claimed"
"""Set on an event whose own ``attempt`` no start event began (the value it claimed)."""


def unbegun_claims(events: list[dict[str, Any]]) -> int:
    """How many of one rank's tagged events claimed an attempt that no start event began."""
    return sum(1 for e in events if UNBEGUN in e)


def attempt_at(starts: list[dict[str, Any]], ts: float) -> int:
    """The attempt of a rank running at wall time ``ts`` (for crash files, timed by mtime)."""
    attempt = starts[0]["attempt"] if starts else 0
    for s in starts:
        if _num(s.get("ts")) <= ts:
            attempt = s["attempt"]
    return attempt


def progress_by_attempt(
    starts: list[dict[str, Any]], progress: dict[str, Any] | None
) -> dict[int, dict[str, Any]]:
    """attempt -> the last step that attempt completed: the progress file for the newest
    attempt, ``previous_progress`` of the next start event for the earlier ones."""
    out: dict[int, dict[str, Any]] = {}
    for before, start in zip(starts, starts[1:], strict=False):
        prev = start.get("previous_progress")
        if isinstance(prev, dict) and isinstance(prev.get("step"), int):
            out[before["attempt"]] = prev
    if progress is not None:
        newest = starts[-1]["attempt"] if starts else 0
        out[newest] = progress
    return out


def summarize(
    events: list[dict[str, Any]],
    first_failure: dict[str, Any] | None,
    last_steps: dict[tuple[int, int], int | None],
) -> dict[str, Any]:
    """``attempts`` (one entry per attempt, on the merged clock) and, when something failed,
    ``last_good_checkpoint`` before the first failure and ``steps_lost`` by a restart from it.

    ``events``: merged, aligned (``t``, ``t_rel``) and attempt-tagged; ``last_steps``: the last
    completed step index per (rank, attempt)."""
    attempts: dict[int, dict[str, Any]] = {}
    for e in events:
        a = attempts.setdefault(e["attempt"], {"attempt": e["attempt"], "ranks": {},
                                               "t_rel_start": e["t_rel"], "resumed_from": None})
        a["t_rel_end"] = e["t_rel"]
        if e.get("kind") == "start":
            a["t_rel_start"] = min(a["t_rel_start"], e["t_rel"])
            a.setdefault("source", e.get("attempt_source"))
        if e.get("kind") == LOAD and e.get("ok") is not False and a["resumed_from"] is None:
            a["resumed_from"] = {
                "step": e.get("resume_step", e.get("step")), "path": e.get("path"),
                "restored": e.get("restored") or [],
                "not_restored": e.get("not_restored") or [],
                "not_stated": e.get("not_stated") or [],
            }
    for (rank, attempt), step in last_steps.items():
        if attempt in attempts:
            attempts[attempt]["ranks"][str(rank)] = {"last_step": step}
    for a in attempts.values():
        steps = [r["last_step"] for r in a["ranks"].values() if isinstance(r["last_step"], int)]
        a["last_step"] = max(steps) if steps else None
        if a["resumed_from"]:
            r = a["resumed_from"]
            r["missing"] = [*r["not_restored"], *r["not_stated"]]
    out: dict[str, Any] = {"attempts": [attempts[k] for k in sorted(attempts)]}
    if first_failure is None:
        return out
    failed = first_failure.get("attempt", 0)
    good = last_good_checkpoint(events, failed, first_failure["t"])
    out["last_good_checkpoint"] = good
    done = attempts.get(failed, {}).get("last_step")
    start = _attempt_start_step(attempts.get(failed))
    base = good["step"] if good else start
    out["steps_lost"] = (done + 1 - base) if isinstance(done, int) else None
    nxt = attempts.get(failed + 1)
    if nxt is not None:
        out["restarted"] = {"attempt": failed + 1, "resumed_from": nxt["resumed_from"]}
    return out


def last_good_checkpoint(
    events: list[dict[str, Any]], attempt: int, before_t: float
) -> dict[str, Any] | None:
    """The newest checkpoint saved before ``before_t`` that every saving rank finished.

    Saves of earlier attempts count too (a restart can resume from them); within the failed
    attempt a step counts only when each rank that saved anything in that attempt saved it."""
    saves = [e for e in events if e.get("kind") == SAVE and e.get("ok") is not False
             and e["t"] <= before_t and e["attempt"] <= attempt and isinstance(e.get("step"), int)]
    if not saves:
        return None
    by_attempt: dict[int, set[int]] = {}
    by_step: dict[int, dict[int, list[dict[str, Any]]]] = {}  # one pass: linear in the saves
    for e in saves:
        by_attempt.setdefault(e["attempt"], set()).add(e.get("rank"))
        by_step.setdefault(e["step"], {}).setdefault(e["attempt"], []).append(e)
    for step in sorted(by_step, reverse=True):
        for a in sorted(by_step[step], reverse=True):
            mine = by_step[step][a]
            ranks = {e.get("rank") for e in mine}
            if ranks >= by_attempt[a]:
                last = max(mine, key=lambda e: e["t"])
                return {"step": step, "path": last.get("path"), "attempt": a,
                        "ranks": sorted(ranks), "t_rel": last["t_rel"]}
    return None


def _attempt_start_step(a: dict[str, Any] | None) -> int:
    if a and a.get("resumed_from") and isinstance(a["resumed_from"].get("step"), int):
        return a["resumed_from"]["step"]
    return 0


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0
