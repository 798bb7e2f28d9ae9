"""One place that turns a probe failure into a count and one log line, never an exception.

``with guard("grads"): ...`` replaces a try/except around every probe: the failure increments
``ddpmon_agent_errors_total{probe="grads"}``, is logged once per probe (later ones are only
counted) and the training loop goes on. A failure to write to the run dir (a full disk, see
:mod:`ddpmon.rundir.writes`) goes to the rank's :class:`~ddpmon.rundir.writes.WriteHealth`
instead, which counts it the same way but logs one line per rank for all writers together.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..rundir.writes import WriteHealth, is_write_error

log = logging.getLogger("ddpmon")


class Guard:
    def __init__(self, count: Callable[[str], None]) -> None:
        self._count = count
        self.writes = WriteHealth(count)
        """Where run-dir write failures of every writer of this rank are counted and told."""
        self._logged: set[str] = set()
        self._scopes: dict[str, _Scope] = {}
        self.failures: dict[str, int] = {}
        """Failures counted so far, by probe (a check that must not count one twice)."""

    def __call__(self, probe: str) -> _Scope:
        scope = self._scopes.get(probe)
        if scope is None:
            scope = self._scopes[probe] = _Scope(self, probe)
        return scope

    def count(self, probe: str) -> None:
        """Count a failure that the caller has already reported in its own words."""
        self.failures[probe] = self.failures.get(probe, 0) + 1
        self._count(probe)

    def taken(self, probe: str, part: Any) -> Any:
        """``part.take()`` (None without a part); a failure is counted under ``probe`` and gives
        None, so one probe's failure loses its own values for the step, not the step."""
        if part is None:
            return None
        with self(probe):
            return part.take()
        return None

    def error(self, probe: str, exc: BaseException) -> None:
        """Count and log (once per probe) a failure; never re-raise into training."""
        if is_write_error(exc):
            self.writes.failed(probe, exc)
            return
        self.failures[probe] = self.failures.get(probe, 0) + 1
        self._count(probe)
        if probe not in self._logged:
            self._logged.add(probe)
            log.warning(
                "ddpmon: probe %r failed (%s: %s); training continues. Further failures of "
                "this probe are only counted in ddpmon_agent_errors_total.",
                probe,
                type(exc).__name__,
                exc,
            )


class _Scope:
    """A reusable context manager (cheaper per use than ``contextlib.contextmanager``)."""

    __slots__ = ("_guard", "_probe")

    def __init__(self, guard: Guard, probe: str) -> None:
        self._guard, self._probe = guard, probe

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False
        self._guard.error(self._probe, exc)
        return True
