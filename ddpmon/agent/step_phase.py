"""The step in progress as an exit path sees it: its number and phase, kept where a signal's
dump finds them (the crash files' live line), and what its hooks saw, for an exception's exit
event (:mod:`.inflight`). A part of ``StepFlow``; its state is the flow's."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..metrics.state import StepRecord
from ..recorder.live_step import CHECKPOINT
from ..strategies.base import GradSummaries

PHASE_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
"""A ``mon.phase`` name: a label value, short and plain."""
MAX_LOOP_PHASES = 16
"""Distinct names ``mon.phase`` exports; later ones are exported as ``other`` (bounded series)."""


class LoopPhase:
    """The phases the loop marked with ``mon.phase(name)``, innermost last."""

    __slots__ = ("stack", "names")

    def __init__(self) -> None:
        self.stack: list[tuple[str, bool]] = []
        self.names: set[str] = set()

    def bounded(self, name: str) -> str:
        if not isinstance(name, str) or not PHASE_NAME.fullmatch(name):
            raise ValueError(f"mon.phase({name!r}): expected a name like 'eval' "
                             "([a-z][a-z0-9_]*, at most 32 characters)")
        if name not in self.names and len(self.names) >= MAX_LOOP_PHASES:
            return "other"
        self.names.add(name)
        return name

    @property
    def current(self) -> tuple[str, bool] | None:
        """``(name, quiet)`` of the innermost marked phase, None outside any. Read on scrape
        threads while the training thread pops: the list is read once (no check-then-index)."""
        innermost = self.stack[-1:]
        return innermost[0] if innermost else None


class StepPhase:
    """Mixed into ``StepFlow`` (which sets ``step``, ``phase``, ``live``, ``source``, the
    tracker and the records lock)."""

    step: int
    phase: int
    live: Any
    source: Any
    tracker: Any
    _outside_checkpoint: int
    _forward_seen: bool
    _backward_pending: bool
    _collected: GradSummaries | None
    _loss: Any
    _records_lock: Any
    phase_since: float = 0.0
    """Wall time the phase last changed (0: not since attach); read by ``activity``."""
    loop_phase: LoopPhase | None = None
    """What ``mon.phase`` marked (made at its first use)."""

    def keep_live(self, live: Any) -> None:
        """Keep the step in progress in ``live`` (the crash capture's ``LiveStep``) from now."""
        self.live = live
        live.set(self.step, self.phase)

    def _at(self, phase: int) -> None:  # hot path: host stores, one mapped write
        if phase != self.phase:
            self.phase_since = time.time()
        self.phase = phase
        self.live.set(self.step, phase)

    @contextmanager
    def marked(self, name: str, quiet: bool = True) -> Iterator[None]:
        """``mon.phase(name)``: the loop says what it does (``eval``, ``save``), so a long
        ``quiet`` phase pages no hang, and a stuck rank is named with it."""
        if self.loop_phase is None:
            self.loop_phase = LoopPhase()
        loop = self.loop_phase
        entry = (loop.bounded(name), bool(quiet))
        loop.stack.append(entry)
        self.phase_since = time.time()
        try:
            yield
        finally:
            if entry in loop.stack:  # the innermost copy: phases nest
                del loop.stack[len(loop.stack) - 1 - loop.stack[::-1].index(entry)]
            self.phase_since = time.time()

    def in_checkpoint(self, inside: bool) -> None:
        """A checkpoint save or load began (``inside``) or ended on the training thread."""
        if inside:
            self._outside_checkpoint = self.phase
        self._at(CHECKPOINT if inside else self._outside_checkpoint)

    @property
    def started(self) -> bool:
        """A first step has started (a forward, a backward or a completed step was seen)."""
        return bool(self.step or self._forward_seen or self._backward_pending)

    def in_flight(self) -> tuple[GradSummaries | None, Any]:
        """Exit path only: what the source has seen of the step in progress and its observed
        loss (device tensors, not read here)."""
        if self._collected is not None:
            return self._collected, self._loss
        inflight = getattr(self.source, "inflight", None)
        return (inflight() if inflight is not None else None), self._loss

    def classify(self, record: StepRecord) -> None:
        """The origin rule for a record built outside ``drain`` (the step in flight)."""
        with self._records_lock:
            self.tracker.classify(record)
