"""Phases the script marks (``with mon.phase("eval"): ...``): evaluation, a profiler window,
anything that is not training but runs inside the job. Each one ends in a ``phase`` event
(name, seconds), which goodput counts as ``custom_badput_events`` (Google's name) and the
ETTR-compatible ratio as productive runtime.

Why a context manager: the phase's time is measured by the process that lived it, with the
same clock as its steps, and nothing runs per step."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


class PhaseTimer:
    """Times one marked phase; on exit appends its ``phase`` event (never raises into the
    script once started; a bad name raises ``ValueError`` at creation)."""

    def __init__(self, name: str, emit: Callable[..., Any], step: Callable[[], int | None],
                 on_error: Callable[[str, BaseException], None]) -> None:
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError(f"phase name {name!r}: expected 1-64 characters of letters, "
                             "digits and _ . : -")
        self.name, self._emit, self._step, self._on_error = name, emit, step, on_error
        self._t0: float | None = None

    def __enter__(self) -> PhaseTimer:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        try:
            seconds = time.perf_counter() - (self._t0 or time.perf_counter())
            self._emit("phase", self._step(), name=self.name, seconds=round(seconds, 6),
                       ok=exc is None)
        except Exception as err:  # noqa: BLE001 - a record, never a failure
            self._on_error("forensics", err)
        return False
