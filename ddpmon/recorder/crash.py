"""Crash capture: how a rank ended, even when Python itself could not say.

- Fatal signals (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL): ``faulthandler`` writes
  ``Fatal Python error: <signal>`` and every thread's stack to ``run_path/crash.rank<R>.txt``
  from inside the signal handler (no Python code can run then, so no event can be written;
  ``ddpmon timeline`` turns the file into a ``signal`` event, timed by the file's mtime).
- SIGTERM (what torchrun sends to surviving ranks when one fails): ``faulthandler.register``
  with ``chain=True`` dumps the stacks to ``run_path/sigterm.rank<R>.txt`` at the signal, even
  if the process is blocked in C++; then :mod:`.term_flush` writes the rank's last records (at
  most ``term_flush.DEADLINE`` seconds, woken by a wakeup fd, not by a Python-level handler that
  would wait for the collective to time out) and the process dies of SIGTERM as before.
- Uncaught exception in the main thread: an ``exit`` event (``reason="exception"``, type,
  message, traceback; the step in flight, its phase and ``running: true`` from the agent's
  ``in_flight``, which first emits what that step's hooks saw: ``ddpmon.agent.inflight``)
  and, under torchelastic, the error file named by
  ``TORCHELASTIC_ERROR_FILE`` in torchelastic's own format (as ``@record`` writes it; an
  existing file is left alone, the first writer wins). Uncaught exceptions in other threads
  become ``thread_exception`` events (the process goes on, so they are not an exit).
- Normal interpreter exit: an ``exit`` event (``reason="normal"``) from ``atexit``. ``os._exit`` and
  SIGKILL leave no event by nature; the timeline reports such ranks as vanished.
- The step in progress: each attempt appends a ``ddpmon-live`` line to both files that the
  training thread keeps current through a shared mapping (:mod:`.live_step`), so a dump names
  the step that was running, and its phase, without lag.
- A clean end leaves no empty files: ``faulthandler`` needs an open descriptor from the start,
  so both files are created at install and removed again at ``uninstall`` or normal exit when
  nothing was written to them (a file that already held an earlier attempt's stacks is kept).
  From then on the previous ``faulthandler`` setting applies (e.g. a crash during interpreter
  teardown goes to stderr if faulthandler was on before, as it would without ddpmon).
  ``code`` is what ``sys.exit`` was given (``sys.exit`` is wrapped while installed to see it);
  a bare ``raise SystemExit(n)`` is reported as 0.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from ..rundir.atomic import write_text_atomic
from ..rundir.layout import RunDir
from .live_step import LINE_LEN, LiveStep
from .term_flush import TermFlush

log = logging.getLogger("ddpmon.crash")

FATAL_SIGNALS = ("SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE", "SIGILL")


def crash_path(run_path: Path | str, rank: int) -> Path:
    return RunDir(run_path).crash(rank)


def sigterm_path(run_path: Path | str, rank: int) -> Path:
    return RunDir(run_path).sigterm(rank)


class CrashCapture:
    """Installs the hooks above for one rank; ``uninstall`` restores the previous ones."""

    def __init__(self, run_path: Path | str, rank: int, eventlog: Any) -> None:
        self.run_path = Path(run_path)
        self.rank = int(rank)
        self.eventlog = eventlog
        self.installed = False
        self._crash_file: Any = None
        self._term_file: Any = None
        self._prev_excepthook: Any = None
        self._prev_threading_hook: Any = None
        self._prev_faulthandler: tuple[bool, Any] | None = None
        self._term_registered = False
        self._exit_emitted = False
        self._exit_code: Any = None
        self._prev_sys_exit: Any = None
        self.term = TermFlush()
        """SIGTERM's flush of the rank's last records (:mod:`.term_flush`); the agent sets
        its ``flush``."""
        self.live = LiveStep()
        """The step in progress, for the training thread to keep current (``live.set``)."""
        self.in_flight: Any = None
        """``() -> dict``: the step in flight's fields for an exception's ``exit`` event (its
        ``step``, ``phase``), set by the agent (``agent.inflight.InFlight.report``), which emits
        what the step's hooks saw before it."""

    def install(self) -> CrashCapture:
        if self.installed:
            return self
        try:
            self.run_path.mkdir(parents=True, exist_ok=True)
            self._prev_faulthandler = (faulthandler.is_enabled(), None)
            # Kept open for the process's lifetime: the C handler writes to its fd.
            self._crash_file = open(crash_path(self.run_path, self.rank), "a")  # noqa: SIM115
            self.live.add(self._crash_file)
            faulthandler.enable(file=self._crash_file, all_threads=True)
            self._register_sigterm()
        except Exception as exc:
            log.warning("ddpmon crash capture: faulthandler not installed: %s", exc)
        self._prev_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        self._prev_threading_hook = threading.excepthook
        threading.excepthook = self._threading_hook
        self._prev_sys_exit = sys.exit
        sys.exit = self._sys_exit
        atexit.register(self._atexit)
        self.installed = True
        return self

    def _register_sigterm(self) -> None:
        if not hasattr(faulthandler, "register") or threading.current_thread() is not (
            threading.main_thread()
        ):
            return
        current = signal.getsignal(signal.SIGTERM)
        if current not in (signal.SIG_DFL, None):
            return  # the program handles SIGTERM itself; leave its semantics alone
        self._term_file = open(sigterm_path(self.run_path, self.rank), "a")  # noqa: SIM115
        self.live.add(self._term_file)
        self.term.install()  # before the dump's registration: the dump chains to it
        faulthandler.register(signal.SIGTERM, file=self._term_file, all_threads=True, chain=True)
        self._term_registered = True

    def uninstall(self) -> None:
        if not self.installed:
            return
        self.installed = False
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_excepthook
        if threading.excepthook == self._threading_hook:
            threading.excepthook = self._prev_threading_hook
        if sys.exit == self._sys_exit:
            sys.exit = self._prev_sys_exit
        atexit.unregister(self._atexit)
        self._release_files()

    def _release_files(self) -> None:
        """Hand the fatal-signal and SIGTERM dumps back to their previous owner, then close
        both files, cut off this attempt's live line where nothing followed it, and remove each
        file that is then empty (nothing happened)."""
        try:
            if self._term_registered:
                faulthandler.unregister(signal.SIGTERM)
                self._term_registered = False
            self.term.uninstall()
            if self._prev_faulthandler is not None:
                if self._prev_faulthandler[0]:
                    faulthandler.enable(file=sys.stderr, all_threads=True)
                else:
                    faulthandler.disable()
                self._prev_faulthandler = None
        except Exception:
            pass
        # unmapped before any cut: no access past the end of the file
        lines = {path: (start, before) for path, start, before in self.live.release()}
        for fh in (self._crash_file, self._term_file):
            if fh is None:
                continue
            try:
                size = os.fstat(fh.fileno()).st_size
                start, before = lines.get(fh.name, (None, 0.0))
                if start is not None and size == start + LINE_LEN:
                    os.truncate(fh.name, start)  # no dump after this attempt's line
                    size = start
                    if before:  # the earlier attempt's dump keeps its time
                        os.utime(fh.name, (before, before))
                fh.close()
                if size == 0:
                    os.unlink(fh.name)
            except Exception:
                pass
        self._crash_file = self._term_file = None

    # -- hooks -----------------------------------------------------------------------------

    def _excepthook(self, exc_type, exc, tb) -> None:
        try:
            if not issubclass(exc_type, SystemExit | KeyboardInterrupt):
                text = "".join(traceback.format_exception(exc_type, exc, tb))
                self._emit_exit(
                    **self._step_in_flight(),
                    reason="exception",
                    code=1,
                    exc_type=exc_type.__name__,
                    message=str(exc)[:2000],
                    traceback=text[-20000:],
                )
                write_torchelastic_error(exc_type, exc, text)
            elif issubclass(exc_type, KeyboardInterrupt):
                self._emit_exit(reason="keyboard_interrupt", code=130)
        except Exception:
            pass
        (self._prev_excepthook or sys.__excepthook__)(exc_type, exc, tb)

    def _step_in_flight(self) -> dict[str, Any]:
        if self.in_flight is None or self._exit_emitted:
            return {}
        try:
            fields = self.in_flight()
            return fields if isinstance(fields, dict) else {}
        except Exception:
            return {}

    def _threading_hook(self, args: Any) -> None:
        try:
            if args.exc_type is not SystemExit:
                self.eventlog.emit(
                    "thread_exception",
                    thread=getattr(args.thread, "name", None),
                    exc_type=args.exc_type.__name__,
                    message=str(args.exc_value)[:2000],
                    traceback="".join(
                        traceback.format_exception(
                            args.exc_type, args.exc_value, args.exc_traceback
                        )
                    )[-20000:],
                )
        except Exception:
            pass
        (self._prev_threading_hook or threading.__excepthook__)(args)

    def _sys_exit(self, code: Any = None) -> None:
        self._exit_code = _normal_code(code)
        self._prev_sys_exit(code)

    def _atexit(self) -> None:
        code = 0 if self._exit_code is None else self._exit_code
        self._emit_exit(reason="normal", code=code)
        self._release_files()  # hooks stay: atexit.unregister from inside atexit is unsafe

    def _emit_exit(self, **fields: Any) -> None:
        if self._exit_emitted:
            return
        self._exit_emitted = True
        try:
            step = fields.pop("step", None)
            self.eventlog.emit("exit", step, **fields)
        except Exception:
            pass


def _normal_code(code: Any) -> int | str:
    if code is None:
        return 0
    return code if isinstance(code, int) else str(code)


def write_torchelastic_error(exc_type: Any, exc: BaseException, text: str) -> bool:
    """Write ``TORCHELASTIC_ERROR_FILE`` like ``torch.distributed.elastic``'s ``@record``.

    Left alone if the file already has content (``@record`` got there first). Written
    atomically: the launcher SIGTERMs the other ranks right after a failure, and an empty file
    left by a rank stopped between open and write made torchrun itself die reading it
    (``json.load`` in ``ProcessFailure``)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    try:
        if os.path.exists(path) and os.path.getsize(path) > 0:
            return False
        data = {
            "message": {
                "message": f"{exc_type.__name__}: {exc}",
                "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))},
            }
        }
        write_text_atomic(path, json.dumps(data))
        return True
    except Exception:
        return False
