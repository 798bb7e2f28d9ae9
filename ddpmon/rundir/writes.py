"""One rank's account of its run-dir writes: a full disk is counted, said once, and closed by a
``write_gap`` event when writing works again.

Why one place: when the run dir's disk fills, every writer of the rank fails at about the same
time (event log, history journal, evidence bundles, summary). Each failure is counted in
``ddpmon_agent_errors_total{probe=...}``, but a line per writer, or per failed write, would
flood the training log exactly when the user needs it. So the writers report here: the first
failure of an *episode* logs one line for the rank; the first later success of a writer that
had failed ends the episode with one more line and one ``write_gap`` event (how long, which
steps, what each writer lost), which ``ddpmon timeline`` shows as the gap.

Never raises, and costs one attribute read per successful write while nothing is failing.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("ddpmon")

WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})
"""Errors that mean "the run dir cannot take this write" (full, over quota, read-only, failing
device, file too large), as opposed to a bug in a writer."""

GAP_KIND = "write_gap"
"""The event kind recorded when writes resume after failing."""


def is_write_error(exc: BaseException) -> bool:
    """True for an ``OSError`` that says the storage refused a write (see :data:`WRITE_ERRNOS`)."""
    return isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS


@dataclass(slots=True)
class WriteGap:
    """One episode of failing writes: when it started, the first error, and per writer
    (``probe``) the failed writes and the items lost for good (event lines, bundles, rows)."""

    started: float
    error: str
    failures: dict[str, int] = field(default_factory=dict)
    lost: dict[str, int] = field(default_factory=dict)
    first_step: int | None = None
    last_step: int | None = None
    opened_by: str = ""
    """The writer whose failure opened the episode."""
    retrying: set[str] = field(default_factory=set)
    """Writers that kept what failed to write it again (``lost=0``: the history's rows)."""

    def note(self, probe: str, lost: int, steps: Iterable[int | None]) -> None:
        self.opened_by = self.opened_by or probe
        if not lost:
            self.retrying.add(probe)
        self.failures[probe] = self.failures.get(probe, 0) + 1
        self.lost[probe] = self.lost.get(probe, 0) + int(lost)
        for step in steps:
            if step is None:
                continue
            step = int(step)
            self.first_step = step if self.first_step is None else min(self.first_step, step)
            self.last_step = step if self.last_step is None else max(self.last_step, step)

    def fields(self, ended: float, resumed_by: str) -> dict[str, Any]:
        """The ``write_gap`` event's fields (its ``step`` is :attr:`last_step`)."""
        seconds = max(0.0, ended - self.started)
        steps = "no step"
        if self.first_step is not None:
            steps = f"steps {self.first_step}-{self.last_step}"
        lost = ", ".join(f"{p} {n}" for p, n in sorted(self.lost.items()) if n) or "nothing"
        return {
            "since_ts": self.started,
            "seconds": round(seconds, 3),
            "first_step": self.first_step,
            "last_step": self.last_step,
            "failures": dict(sorted(self.failures.items())),
            "lost": dict(sorted(self.lost.items())),
            "resumed_by": resumed_by,
            "error": self.error,
            "detail": f"writes failed for {seconds:.1f} s ({steps}); lost: {lost}",
        }


class WriteHealth:
    """Shared by the writers of one rank; thread-safe. ``emit(kind, step, **fields)`` (set with
    :meth:`connect`) records the gap event; ``count(probe)`` bumps the error counter."""

    def __init__(self, count: Callable[[str], None]) -> None:
        self._count = count
        self._lock = threading.Lock()
        self._gap: WriteGap | None = None
        self._emit: Callable[..., None] | None = None
        self._where = "the run dir"
        self.episodes = 0
        """Episodes so far (each one logged two lines: failing, resumed)."""

    def connect(self, *, rank: int, run_path: Any, emit: Callable[..., None] | None) -> None:
        """Name the rank and run dir in the log lines; where to record the gap event."""
        self._where = f"rank {rank} run dir {run_path}"
        self._emit = emit

    @property
    def failing(self) -> bool:
        return self._gap is not None

    def failed(
        self, probe: str, exc: BaseException, *, lost: int = 1, steps: Iterable[int | None] = ()
    ) -> None:
        """A write of ``probe`` failed; ``lost`` items are gone for good (0 when the writer keeps
        them to retry); ``steps`` the steps they belonged to."""
        try:
            self._count(probe)
            with self._lock:
                gap = self._gap
                first = gap is None
                if gap is None:
                    gap = self._gap = WriteGap(time.time(), f"{type(exc).__name__}: {exc}")
                    self.episodes += 1
                gap.note(probe, lost, steps)
            if first:
                log.warning(
                    "ddpmon: %s: writes fail (%s: %s, first by %s); training continues, failed "
                    "writes are counted in ddpmon_agent_errors_total and a write_gap event is "
                    "recorded when writing resumes",
                    self._where, type(exc).__name__, exc, probe,
                )
        except Exception:  # never into training
            pass

    def succeeded(self, probe: str) -> None:
        """A write of ``probe`` worked. The episode ends when the writer that opened it writes
        again, or one that kept its items to retry wrote them: on a full disk a small append of
        another writer can still land in a page its file holds, which is not space coming back."""
        if self._gap is None:  # the common case: one attribute read
            return
        try:
            with self._lock:
                gap = self._gap
                if gap is None or probe not in gap.failures:
                    return
                if probe != gap.opened_by and probe not in gap.retrying:
                    return
                self._gap = None
            fields = gap.fields(time.time(), probe)
            log.warning("ddpmon: %s: writes resume; %s", self._where, fields["detail"])
            if self._emit is not None:
                self._emit(GAP_KIND, gap.last_step, **fields)
        except Exception:
            pass
