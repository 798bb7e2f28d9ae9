"""Checkpoint saves and loads, and restart attempts, as one rank records them.

Why: after a failure the operator decides where to restart from and what that costs. That needs
the last checkpoint every rank completed, the step a resume starts at, which state a resume
restored, and which attempt of the run each event belongs to (a torchelastic restart reuses the
run id and the run dir).

- ``Monitor.observe_checkpoint(step, path, kind)`` returns a :class:`CheckpointTimer`: a context
  manager (or ``.done()`` for code that cannot use ``with``) that times the save or load. It never
  reads a device value; on exit it updates the metric state, appends a ``checkpoint_save`` or
  ``checkpoint_load`` event and, for a load, keeps the recovery conditions for the manifest.
  ``step`` is the step a resume from this checkpoint starts at (the optimizer steps it holds).
- ``torch.distributed.checkpoint`` ``save``/``async_save``/``load`` are captured without patching
  anything: DCP already reports every call (start, end, time spent, checkpoint id) to its own
  logger, and :class:`DcpCapture` adds one handler to it. Calls made while an explicit timer is
  open on the same thread are left to the timer (no double count). For ``async_save`` only the
  blocking part (staging) is timed; the background write is not awaited. The logger is reached
  only when the user's script imported ``torch.distributed.checkpoint`` before ``attach``:
  importing it ourselves costs seconds at startup.
- The attempt number: torchelastic's ``TORCHELASTIC_RESTART_COUNT``, or the ``start`` events
  already in this rank's event log (the run dir is the counter), whichever is larger.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._torch_compat import dcp_logger
from ..job.slurm import restart_count
from ..metrics.state import CHECKPOINT_KINDS, MetricState
from ..recorder.eventlog import read_progress

log = logging.getLogger("ddpmon.checkpoints")

RESTORABLE = ("model", "optimizer", "scaler", "rng", "data_loader")
"""States a resume may restore; each one not restored can make the resumed run differ."""

SIZE_SCAN_MAX_FILES = 10_000
"""A checkpoint directory with more files than this is not sized (the walk would cost time)."""


@dataclass(frozen=True, slots=True)
class Attempt:
    number: int
    """0 at first launch, N after N restarts."""
    source: str
    """``torchelastic`` (TORCHELASTIC_RESTART_COUNT) or ``run_dir`` (earlier start events)."""
    previous_progress: dict[str, Any] | None = None
    """The last step the previous attempt of this rank completed (its progress file, read
    before this attempt overwrites it): the timeline needs it for a rank that was killed."""


def detect_attempt(
    events_file: Path, progress_file: Path, environ: Mapping[str, str] | None = None
) -> Attempt:
    """This process's attempt; call before the ``start`` event is written."""
    environ = os.environ if environ is None else environ
    elastic = _int(environ.get("TORCHELASTIC_RESTART_COUNT"))

    requeues = restart_count(environ)
    try:
        starts = Path(events_file).read_bytes().count(b'"kind":"start"')
    except OSError:
        starts = 0
    number, source = starts, "run_dir"
    if elastic is not None and elastic >= starts:
        number, source = elastic, "torchelastic"
    if requeues is not None and requeues > number:
        number, source = requeues, "slurm"
    previous = None
    if number > 0:
        previous = read_progress(progress_file)
    return Attempt(number, source, previous)


def _int(raw: str | None) -> int | None:
    try:
        value = int(raw) if raw not in (None, "") else None
    except ValueError:
        return None
    return value if value is None or value >= 0 else None


@dataclass(slots=True)
class CheckpointObserver:
    """Turns finished saves and loads into metric state, events and recovery conditions."""

    state: MetricState
    emit: Callable[..., None]
    guard: Any
    on_load: Callable[[int], None] = lambda step: None
    """Called with the resume step after a successful load (the monitor rebases its counter)."""
    present: Callable[[], frozenset[str]] = lambda: frozenset(RESTORABLE)
    """The states this run has (a run without a GradScaler has no scaler to restore): a
    restore claim names only these."""
    recovery: dict[str, Any] | None = None
    """The last successful load: resume step, path, restored and missing states."""
    last_save: dict[str, Any] | None = None
    """The last successful save: ``{"step", "path"}`` (named by ``LossScaleFloorError``)."""
    phase: Callable[[bool], None] = lambda inside: None
    """Told when a timed save or load starts (True) and ends on the main thread: the step in
    progress is then in its checkpoint phase (``StepFlow.in_checkpoint``)."""
    _local: threading.local = field(default_factory=threading.local)

    def timer(self, step: int, path: Any, kind: str, restored: dict[str, bool | None],
              size: int | None, source: str = "explicit") -> CheckpointTimer:
        if kind not in CHECKPOINT_KINDS:
            raise ValueError(f"observe_checkpoint(kind={kind!r}): expected 'save' or 'load'")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"observe_checkpoint(step={step!r}): expected an int >= 0")
        return CheckpointTimer(self, kind, step, str(path), restored, size, source)

    # -- explicit timers on this thread (DCP records inside them are not counted twice) ------
    def enter(self) -> None:
        self._local.depth = getattr(self._local, "depth", 0) + 1
        if self._local.depth == 1 and threading.current_thread() is threading.main_thread():
            self.phase(True)

    def leave(self, failed: bool = False) -> None:
        """``failed``: an exception leaves the save or load; the phase stays the checkpoint's
        for the exit event (the next phase of training replaces it if the loop goes on)."""
        self._local.depth = max(0, getattr(self._local, "depth", 0) - 1)
        main = threading.current_thread() is threading.main_thread()
        if self._local.depth == 0 and main and not failed:
            self.phase(False)

    def inside_timer(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    def finish(
        self,
        *,
        kind: str,
        step: int,
        path: str | None,
        seconds: float,
        size: int | None,
        error: BaseException | str | None,
        restored: dict[str, bool | None],
        source: str,
        **extra: Any,
    ) -> None:
        """Record one save or load that just ended. Never raises."""
        with self.guard("checkpoint"):
            finished = time.time()
            fields: dict[str, Any] = {"path": path, "seconds": round(seconds, 6), "source": source}
            if error is not None:
                message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
                self.emit(f"checkpoint_{kind}", step, ok=False, error=message[:500], **fields)
                return
            if kind == "save" and size is None and path and not extra.get("async_write"):
                size = path_size(Path(path))
            self.state.apply_checkpoint(kind, step, seconds, finished, size)
            stated = {k: v for k, v in restored.items() if v is not None}
            if kind == "save":
                if stated:
                    fields["contains"] = stated
                self.last_save = {"step": step, "path": path}
                self.emit("checkpoint_save", step, ok=True, bytes=size, **fields, **extra)
                return
            # A captured DCP load only knows the step in progress, not the step it resumes at.
            explicit = source == "explicit"
            recovery = recovery_conditions(
                step if explicit else None, path, restored, source, self.present()
            )
            self.recovery = recovery
            self.emit(
                "checkpoint_load", step, ok=True, resume_step=recovery["resume_step"],
                restored=recovery["restored"], not_restored=recovery["not_restored"],
                not_stated=recovery["not_stated"], absent=recovery["absent"], **fields, **extra,
            )
            if recovery["not_restored"]:
                log.warning(
                    "ddpmon: resumed from step %s (%s) without restoring %s; the resumed run "
                    "may differ from an uninterrupted one",
                    recovery["resume_step"], path, ", ".join(recovery["not_restored"]),
                )
            if recovery["not_stated"]:
                log.info(
                    "ddpmon: resumed from step %s (%s); whether it restored %s was not stated "
                    "(observe_checkpoint(kind='load', %s=True) says so)",
                    recovery["resume_step"], path, ", ".join(recovery["not_stated"]),
                    recovery["not_stated"][0],
                )
            if explicit:
                self.on_load(step)


def recovery_conditions(
    step: int | None,
    path: str | None,
    restored: Mapping[str, bool | None],
    source: str,
    present: frozenset[str] = frozenset(RESTORABLE),
) -> dict[str, Any]:
    """What a resume restored: the manifest's ``recovery`` entry and the load event's fields.
    ``step`` None: not known (a captured DCP load; call ``observe_checkpoint`` to state it).
    Only states in ``present`` (the ones this run has) are named; the others are ``absent``."""
    kinds = [k for k in RESTORABLE if k in present]
    return {
        "resume_step": None if step is None else int(step),
        "path": path,
        "source": source,
        "restored": [k for k in kinds if restored.get(k) is True],
        "not_restored": [k for k in kinds if restored.get(k) is False],
        "not_stated": [k for k in kinds if restored.get(k) is None],
        "absent": [k for k in RESTORABLE if k not in present],
        "time": time.time(),
    }


def path_size(path: Path) -> int | None:
    """Bytes of a checkpoint file, or of every file under a checkpoint directory (DCP writes a
    directory); None when absent, unreadable or too many files to walk."""
    try:
        if path.is_file():
            return path.stat().st_size
        if not path.is_dir():
            return None
        total, count = 0, 0
        for root, _dirs, files in os.walk(path):
            for name in files:
                count += 1
                if count > SIZE_SCAN_MAX_FILES:
                    return None
                total += os.stat(os.path.join(root, name)).st_size
        return total
    except OSError:
        return None


class CheckpointTimer:
    """Times one save or load from the ``observe_checkpoint`` call (or ``with`` entry) to its
    exit or ``done()``. An exception inside ``with`` is recorded as a failed save/load (not a
    checkpoint) and propagates unchanged."""

    def __init__(self, observer: CheckpointObserver, kind: str, step: int, path: str,
                 restored: dict[str, bool | None], size: int | None, source: str) -> None:
        self._observer = observer
        self.kind, self.step, self.path = kind, step, path
        self._restored, self._size, self._source = restored, size, source
        self._t0 = time.perf_counter()
        self._entered = False
        self.finished = False

    def __enter__(self) -> CheckpointTimer:
        self._t0 = time.perf_counter()
        self._entered = True
        self._observer.enter()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if self._entered:
            self._entered = False
            self._observer.leave(failed=exc is not None)
        self.done(error=exc)
        return False

    def done(self, *, size: int | None = None, error: BaseException | str | None = None) -> None:
        """End the timing now (idempotent). ``size``: bytes written, if you know them."""
        if self.finished:
            return
        self.finished = True
        self._observer.finish(
            kind=self.kind, step=self.step, path=self.path,
            seconds=time.perf_counter() - self._t0, size=size if size is not None else self._size,
            error=error, restored=self._restored, source=self._source,
        )


class NullTimer:
    """What a disabled monitor returns: a context manager that records nothing."""

    finished = True

    def __enter__(self) -> NullTimer:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False

    def done(self, **_: Any) -> None:
        pass


DCP_CALLS = {"save": "save", "async_save": "save", "load": "load"}
"""DCP function names (as its logger reports them) -> checkpoint kind."""


class DcpCapture(logging.Handler):
    """A handler on torch.distributed.checkpoint's own logger: every ``save``, ``async_save``
    and ``load`` made on the training thread becomes a checkpoint record, at the monitor's
    current step. Calls on other threads (DCP's background writer re-enters ``save``) and
    calls inside an explicit timer are ignored."""

    def __init__(self, observer: CheckpointObserver, current_step: Callable[[], int]) -> None:
        super().__init__(logging.DEBUG)
        self._observer = observer
        self._step = current_step
        self._thread = threading.get_ident()
        self._logger: logging.Logger | None = None

    def install(self) -> bool:
        """True when DCP was imported already and the handler is on its logger."""
        target = dcp_logger()
        if target is None:
            return False
        target.addHandler(self)
        self._logger = target
        return True

    def uninstall(self) -> None:
        if self._logger is not None:
            self._logger.removeHandler(self)
            self._logger = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.msg
            if not isinstance(msg, dict) or threading.get_ident() != self._thread:
                return
            kind = DCP_CALLS.get(str(msg.get("func_name")))
            event = msg.get("event")
            if kind is None or event not in ("end", "exception"):
                return
            if self._observer.inside_timer():
                return
            func = str(msg.get("func_name"))
            seconds = float(msg.get("times_spent") or 0) / 1e9
            extra = {"async_write": True} if func == "async_save" else {}
            self._observer.finish(
                kind=kind, step=int(self._step()), path=msg.get("checkpoint_id"),
                seconds=seconds, size=None,
                error=str(msg.get("error")) if event == "exception" else None,
                restored={}, source=f"dcp.{func}", **extra,
            )
        except Exception:  # a logging handler must never raise into DCP
            pass


def tag_attempt(emit: Callable[..., None], attempt: int) -> Callable[..., None]:
    """``emit`` that adds ``attempt`` to every event, so event files keep attempts apart."""

    def tagged(kind: str, step: int | None, **fields: Any) -> None:
        fields.setdefault("attempt", attempt)
        emit(kind, step, **fields)

    return tagged


class AttemptEvidence:
    """The rank's evidence writer with ``attempt`` added to every bundle's info, so bundles of
    a restarted attempt (which may repeat the steps of the one before) stay apart."""

    def __init__(self, writer: Any, attempt: int) -> None:
        self._writer = writer
        self._attempt = attempt

    def write(self, kind: str, step: int | None, info: dict[str, Any], **kw: Any) -> Any:
        return self._writer.write(kind, step, {**info, "attempt": self._attempt}, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)


def tag_evidence(writer: Any, attempt: int) -> Any:
    return None if writer is None else AttemptEvidence(writer, attempt)
