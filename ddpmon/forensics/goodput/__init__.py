"""Goodput: where a job's wall-clock time went, across restarts (:mod:`.account`), in the
buckets of :mod:`.buckets`; ``of_timeline`` computes it for a built timeline."""

from __future__ import annotations

from typing import Any

from ...rundir.layout import RunDir
from .account import Goodput, account
from .buckets import BUCKETS, NAMES
from .rows import rows_by_rank

__all__ = ["BUCKETS", "NAMES", "Goodput", "account", "of_timeline"]


def of_timeline(tl: Any, now: float | None = None) -> Goodput | None:
    """Goodput of a :class:`~ddpmon.forensics.timeline.Timeline` (its run dir's step rows read
    here); None when the run has no start event. Never raises on damaged files: they are
    named in the timeline's ``damage``."""

    rows = rows_by_rank(RunDir(tl.run_path), tl.damage)
    progress = {r: v["progress"] for r, v in tl.ranks.items() if isinstance(v.get("progress"),
                                                                              dict)}
    try:
        return account(tl.events, tl.recovery.get("attempts") or [], rows, progress, now)
    except (ArithmeticError, LookupError, TypeError, ValueError) as exc:
        # a claim no reader checked (a clock of 1e308, a step of another type): the timeline
        # stands, goodput is named as not computed
        tl.damage.add(tl.run_path, f"goodput not computed ({type(exc).__name__}: "
                      f"{str(exc)[:120]})", "no goodput")
        return None
