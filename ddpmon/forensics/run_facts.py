"""Run-level files read tolerantly for compare and report: the manifest, and the resumes a
run's event logs record (what each resume did not restore).

Why a module of its own: ``compare``, ``report`` and ``manifest`` read the same files and must
say the same thing when one is damaged (see :mod:`ddpmon.rundir.damage`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..rundir.damage import ReadWarnings, check_version, read_json, read_json_lines
from ..rundir.layout import EVENTS_RE, HISTORY_JOURNAL_RE, HISTORY_RE, PROGRESS_RE, RunDir
from . import attempts as att

MANIFEST_SCHEMA = 1
"""The manifest ``schema`` this ddpmon writes and reads."""


def load_manifest(
    run_path: Path | str, damage: ReadWarnings, kept: str = "run facts from it not used"
) -> dict[str, Any] | None:
    """``manifest.json`` as a dict; None when absent or damaged (then named in ``damage``).
    A newer ``schema`` is warned about and its known fields are still read."""
    path = RunDir(run_path).manifest()
    data = read_json(path, damage, kept=kept)
    if data is not None:
        check_version(data, "schema", MANIFEST_SCHEMA, path, damage)
    return data


def ranks_present(run: RunDir) -> set[int]:
    """Every rank that left any file (history, journal, events, progress): the ranks a run had
    when its manifest cannot say."""
    out: set[int] = set()
    for pattern in (HISTORY_RE, HISTORY_JOURNAL_RE, EVENTS_RE, PROGRESS_RE):
        out |= set(run.ranked(pattern))
    return out


@dataclass(frozen=True, slots=True)
class Resume:
    """A resume from a checkpoint, as a ``checkpoint_load`` event recorded it."""

    attempt: int
    step: int | None
    """The first step the resumed run computes (a checkpoint's step count)."""
    missing: tuple[str, ...]
    """States not restored, or not stated as restored (e.g. ``optimizer``)."""

    def to_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "step": self.step, "missing": list(self.missing)}


def resumes(run_path: Path | str, damage: ReadWarnings) -> list[Resume]:
    """Every attempt's first successful checkpoint load, from the lowest rank that logged one.
    Every rank's log is read, so each damaged one is named (an empty log beside logs that have
    lines is damage too: its rank's resumes are unknown)."""
    logs = {rank: read_json_lines(f, damage, valid=lambda o: isinstance(o, dict) and "kind" in o)
            for rank, f in sorted(RunDir(run_path).ranked(EVENTS_RE).items())}
    if any(logs.values()):
        for rank, events in logs.items():
            f = RunDir(run_path).events(rank)
            if not events and damage.name(f) not in damage.files():
                damage.add(f, "empty", f"no events from rank {rank}")
    for events in logs.values():
        att.tag_attempts(events)
        found: dict[int, Resume] = {}
        for e in events:
            if e.get("kind") != att.LOAD or e.get("ok") is False or e["attempt"] in found:
                continue
            step = e.get("resume_step", e.get("step"))
            missing = [str(x) for key in ("not_restored", "not_stated")
                       for x in (e.get(key) if isinstance(e.get(key), list) else [])]
            found[e["attempt"]] = Resume(e["attempt"], step if isinstance(step, int) else None,
                                         tuple(missing))
        if found:
            return [found[k] for k in sorted(found)]
    return []
