"""What this rank is doing now, read at scrape time: its phase, the collective it is in, and,
once it has made no progress for ``hang_seconds``, where it is stuck.

Nothing here runs on the training thread. The step flow keeps its phase and when it began
(two host stores per phase change, ``step_phase``); the collectives come from torch's flight
recorder, which c10d keeps for gloo and NCCL alike (each group's last issued sequence number
and the collectives not completed yet: op, group, sequence number, issue time); the stuck
frame from this process's own stacks (``user_frame``). The recorder is read only once the rank
has shown no progress for a second, so a busy rank costs one clock read per scrape.

Progress is a completed step, a phase change or a new collective issued on any group; a rank
with none for ``hang_seconds`` exports ``ddpmon_stuck_seconds{phase, frame, quiet}``. ``quiet``
marks a phase that may rightly last (a checkpoint save or load, anything before the first
completed step: compilation, warm-up, the first collective; a ``mon.phase()``): the hang alert
never pages on a rank the others wait for while it is in one.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import metrics as m
from .._torch_compat import flight_recorder_state
from ..recorder.live_step import AFTER_BACKWARD, CHECKPOINT, DATA, FORWARD, OPTIMIZER
from .user_frame import innermost_user_frame

PHASE_NAMES = {DATA: "data", FORWARD: "forward_backward", AFTER_BACKWARD: "after_backward",
               OPTIMIZER: "optimizer", CHECKPOINT: "checkpoint"}
"""The step flow's phases as exported (``live_step``'s codes)."""
QUIET_PHASES = frozenset({CHECKPOINT})
KNOWN_OPS = frozenset({*m.COLLECTIVE_OPS, "barrier", "all_to_all", "gather", "scatter",
                       "all_gather_into_tensor", "reduce_scatter_tensor", "allreduce_coalesced"})
"""Ops exported by name (the ``op`` label); any other is ``other`` (bounded series)."""
MAX_GROUPS = 16
"""Process groups exported per rank: those with a collective in flight first, then by number
(bounded series)."""
RECORDER_AFTER_SECONDS = 1.0
"""The flight recorder is read once the rank has shown no progress for this long."""


@dataclass(frozen=True, slots=True)
class InFlight:
    """The oldest collective a rank has not completed on one group."""

    group: str
    op: str
    seq: int
    since: float
    """Wall time it was issued."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    phase: str
    phase_since: float
    quiet: bool
    sequences: dict[str, int] = field(default_factory=dict)
    inflight: tuple[InFlight, ...] = ()
    stuck_seconds: float | None = None
    """Seconds without progress, past ``hang_seconds``; None while the rank progresses."""
    frame: str | None = None
    """Innermost user frame of the training thread (only when stuck)."""


def op_name(profiling_name: Any) -> str:
    """``gloo:all_reduce`` / ``nccl:all_reduce`` -> ``all_reduce``; unknown ops -> ``other``."""
    op = str(profiling_name).rpartition(":")[2].strip().lower()
    op = {"allreduce": "all_reduce", "allgather": "all_gather", "_allgather_base":
          "all_gather_into_tensor", "_reduce_scatter_base": "reduce_scatter_tensor"}.get(op, op)
    return op if op in KNOWN_OPS else "other"


@dataclass(frozen=True, slots=True)
class Collectives:
    """What the flight recorder says of this rank's collectives."""

    sequences: dict[str, int] = field(default_factory=dict)
    """Each group's last issued sequence number."""
    inflight: tuple[InFlight, ...] = ()
    last_issued: float = 0.0
    """Wall time the newest recorded collective was issued (0: none)."""


def read_collectives(data: dict | None) -> Collectives:
    """Each group's last issued sequence number and oldest uncompleted collective, from a
    flight-recorder JSON dump (``pg_status`` and ``entries``); hostile-tolerant."""
    sequences: dict[str, int] = {}
    inflight: dict[str, InFlight] = {}
    last_issued = 0.0
    if not isinstance(data, dict):
        return Collectives()
    status = data.get("pg_status")
    for group, fields in (status.items() if isinstance(status, dict) else ()):
        try:
            sequences[str(group)] = int(fields["last_enqueued_collective"])
        except (KeyError, TypeError, ValueError):
            continue
    entries = data.get("entries")
    for entry in entries if isinstance(entries, list) else ():
        try:
            since = int(entry["time_created_ns"]) / 1e9
            last_issued = max(last_issued, since)
            if entry.get("state") == "completed" or entry.get("retired") or entry.get("is_p2p"):
                continue
            group = str(entry["process_group"][0])
            seq = int(entry["collective_seq_id"])
        except (AttributeError, KeyError, IndexError, TypeError, ValueError):
            continue
        if seq <= 0 or (group in inflight and inflight[group].seq <= seq):
            continue
        if sequences.get(group, seq) < seq:
            continue
        inflight[group] = InFlight(group, op_name(entry.get("profiling_name")), seq, since)
    hung = sorted((g for g in inflight if g in sequences), key=_group_order)[:MAX_GROUPS]
    rest = sorted((g for g in sequences if g not in inflight), key=_group_order)
    names = sorted([*hung, *rest][:MAX_GROUPS], key=_group_order)
    return Collectives({g: sequences[g] for g in names},
                       tuple(inflight[g] for g in hung), last_issued)


def _group_order(group: str) -> tuple[int, int, str]:
    """Numeric group names by number ("2" before "10"), any other name after them."""
    return (0, int(group), group) if group.isdecimal() else (1, 0, group)


class Activity:
    """Reads the rank's activity for a scrape (scrape threads; one at a time)."""

    def __init__(self, flow: Any, steps_done: Callable[[], int],
                 last_step_at: Callable[[], float], hang_seconds: float, thread_id: int,
                 *, read_recorder: Callable[[], dict | None] = flight_recorder_state,
                 clock: Callable[[], float] = time.time,
                 on_error: Callable[[str, BaseException], None] | None = None) -> None:
        self.flow = flow
        self.steps_done = steps_done
        self.last_step_at = last_step_at
        self.hang_seconds = float(hang_seconds)
        self.thread_id = thread_id
        self.read_recorder = read_recorder
        self.clock = clock
        self.on_error = on_error
        self._lock = threading.Lock()
        self._attached_at = clock()
        self._last = Collectives()
        self._recorder_broken = False

    def _phase(self) -> tuple[str, bool]:
        loop = self.flow.loop_phase
        marked = loop.current if loop is not None else None
        if marked is not None:
            return marked
        code = self.flow.phase
        return PHASE_NAMES.get(code, "data"), code in QUIET_PHASES

    def snapshot(self) -> Snapshot:
        with self._lock:
            now = self.clock()
            phase, quiet = self._phase()
            since = self.flow.phase_since or self._attached_at
            progress = max(since, self.last_step_at() or 0.0, self._last.last_issued)
            if now - progress < RECORDER_AFTER_SECONDS:
                return Snapshot(phase, since, quiet, dict(self._last.sequences))
            seen = self._last = self._collectives()
            progress = max(progress, seen.last_issued)
            quiet = quiet or self.steps_done() == 0
            idle = now - progress
            if idle < self.hang_seconds:
                return Snapshot(phase, since, quiet, seen.sequences, seen.inflight)
            frame = innermost_user_frame(self.thread_id)
            return Snapshot(phase, since, quiet, seen.sequences, seen.inflight, idle,
                            frame or "unknown")

    def _collectives(self) -> Collectives:
        if self._recorder_broken:
            return Collectives(dict(self._last.sequences))
        try:
            return read_collectives(self.read_recorder())
        except Exception as exc:  # no recorder in this build, a dump that fails: phase only
            self._recorder_broken = True
            if self.on_error is not None:
                self.on_error("activity", exc)
            return Collectives(dict(self._last.sequences))

    def stall_fields(self) -> dict[str, Any]:
        """What the stall event records (the watchdog's thread): phase, frame, the collective
        in flight and each group's sequence number, so ``ddpmon timeline`` names them."""
        s = self.snapshot()
        frame = s.frame or innermost_user_frame(self.thread_id)
        out: dict[str, Any] = {"phase": s.phase, "sequences": s.sequences}
        if frame:
            out["frame"] = frame
        if s.inflight:
            f = s.inflight[0]
            out["collective"] = {"op": f.op, "group": f.group, "seq": f.seq}
        return out

    def samples(self) -> dict[m.Metric, list[tuple[tuple[str, ...], float]]]:
        """The families of ``ddpmon.metrics`` this snapshot fills."""
        s = self.snapshot()
        out: dict[m.Metric, list[tuple[tuple[str, ...], float]]] = {
            m.PHASE_SINCE: [((s.phase,), s.phase_since)],
        }
        if s.sequences:
            out[m.COLLECTIVE_SEQUENCE] = [((g,), float(v)) for g, v in s.sequences.items()]
        if s.inflight:
            out[m.COLLECTIVE_INFLIGHT_SINCE] = [((f.group, f.op), f.since) for f in s.inflight]
            out[m.COLLECTIVE_INFLIGHT_SEQUENCE] = [((f.group, f.op), float(f.seq))
                                                   for f in s.inflight]
        if s.stuck_seconds is not None:
            out[m.STUCK] = [((s.phase, s.frame or "unknown", "1" if s.quiet else "0"),
                             s.stuck_seconds)]
        return out


class LoopPhases:
    """``Monitor``'s part of this module: ``mon.phase()`` and the activity its endpoint
    serves (a mixin, so the monitor only names it)."""

    flow: Any
    config: Any
    guard: Any
    endpoint: Any
    _state: Any

    def phase(self, name: str, quiet: bool = True) -> Any:
        """``with mon.phase("eval"):`` says what the loop does where ddpmon cannot see it (an
        evaluation pass, a save it does not time). While inside, the rank exports the phase by
        that name; a ``quiet`` phase (the default) may last: no hang is paged on it. A name is
        ``[a-z][a-z0-9_]*`` (32 characters at most); past 16 distinct names, ``other``. On
        exit it is a ``phase`` event with its seconds, which goodput counts apart from training
        (``custom_badput_events``, docs/goodput.md)."""
        with contextlib.ExitStack() as stack:  # a bad name raises here, leaving nothing open
            stack.enter_context(self.flow.marked(name, quiet))
            stack.enter_context(self._phase_timer(name))  # type: ignore[attr-defined]
            return stack.pop_all()

    def _serve_activity(self) -> None:
        """Export this rank's activity at every scrape (called on the training thread, at
        attach: the thread whose frames a stuck rank reports)."""
        state = self._state
        self.activity = Activity(
            self.flow, lambda: state.steps_total,
            lambda: state.last_step_timestamp or 0.0, self.config.hang_seconds,
            threading.get_ident(), on_error=self.guard.error,
        )
        self.endpoint.exposition.serve_at_scrape(self.activity.samples, self.guard.error)

    def _stall_fields(self) -> dict[str, Any]:
        """The stall event's activity fields; none when reading them fails (counted), so the
        stall event and its evidence are still written."""
        with self.guard("activity"):
            return self.activity.stall_fields()
        return {}
