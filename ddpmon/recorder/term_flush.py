"""SIGTERM: the rank's last records reach their files before the process dies of it.

torchrun stops the surviving ranks with SIGTERM when one fails, and Slurm stops a job with it
(``scancel``, a preemption, the time limit). The steps a rank completed in its last second are the
ones a post-mortem needs most, and they were still in memory: records are delivered every 50 ms
and the history journal is written every second, so a SIGTERM lost them as a SIGKILL does.

How, in order:

1. ``faulthandler`` dumps every thread's stack at the signal, in C (:mod:`.crash`), then chains
   to Python's own handler, which notes the signal and writes its number to a wakeup fd.
2. A watcher thread blocked on that fd wakes at once, also while the training thread waits in a
   C++ collective that runs no Python (the reason a plain Python handler was not enough: it would
   run only when the collective returned or timed out).
3. It runs the flush (``flush(deadline)``: the records whose values are on the host delivered,
   the history journal written) on a helper thread and waits for it at most ``DEADLINE`` seconds.
4. It restores SIGTERM's default action and sends SIGTERM again: the process dies of SIGTERM, as
   before (exit status -15 to its launcher), later by the flush. Should the training thread run
   Python first, its handler waits for the same flush and does the same.

Nothing here waits for a device or a peer: the flush delivers only what has arrived. A second
SIGTERM during the flush adds no second stack dump.

Installed only from the main thread and only where nothing else wants SIGTERM or the wakeup
fd (a program's own handler, an event loop's wakeup fd): there, SIGTERM kills at once as
before. A handler the program sets later (Lightning's SLURM requeue, a graceful shutdown) owns
SIGTERM from then on: the watcher leaves it alone, and so does this handler when the later one
calls it (Lightning's calls the handler it replaced, which for SIGTERM's default action it would
not). Something that takes the wakeup fd later (an event loop's signal handlers) leaves only
the handler: the flush then runs when the training thread next runs Python, which a rank
waiting in a collective does only when the collective returns. A forked child (a DataLoader
worker) gets SIGTERM's default action back and drops the wakeup fd at the fork
(``os.register_at_fork``): it must neither flush the parent's files nor wake the parent's
watcher, and its stack is not the rank's (no dump into the rank's SIGTERM file either).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ddpmon.crash")

DEADLINE = 5.0
"""Seconds the flush may take before the process dies regardless (launchers send SIGKILL only
after a grace of tens of seconds: torchrun's and Slurm's ``KillWait`` default to 30 s). It
runs in about 0.2 s; the margin is for a history thread still importing pyarrow when a rank
is stopped just after attach, on a loaded machine."""

_current: TermFlush | None = None
"""The installed instance (one per process), for the fork hook."""


class TermFlush:
    """The SIGTERM flush of one process (see module doc)."""

    def __init__(self, deadline: float = DEADLINE) -> None:
        self.deadline = deadline
        self.flush: Callable[[float], None] | None = None
        """``flush(deadline)`` (a ``time.monotonic()`` value), set by the agent; None: die at
        once."""
        self.installed = False
        self._pid = os.getpid()
        self._lock = threading.RLock()
        """Re-entrant: a second SIGTERM's handler can run on the main thread inside the first."""
        self._started = False
        self._done = threading.Event()
        self._read_fd = self._write_fd = -1
        self._libc_signal: Any = None

    def install(self) -> bool:
        """Take SIGTERM and the wakeup fd (main thread only; False, nothing changed, where
        either is taken). Call before ``faulthandler.register`` so that it chains to this."""
        global _current
        if threading.current_thread() is not threading.main_thread() or _current is not None:
            return False
        if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
            return False
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(read_fd)
            os.close(write_fd)
            return False
        if previous != -1:  # an event loop's: leave it, and SIGTERM, alone
            signal.set_wakeup_fd(previous)
            os.close(read_fd)
            os.close(write_fd)
            return False
        self._read_fd, self._write_fd = read_fd, write_fd
        self._libc_signal = _libc_signal()
        signal.signal(signal.SIGTERM, self._on_signal)
        _current, self.installed = self, True
        _register_fork_hook()
        threading.Thread(target=self._watch, name="ddpmon-sigterm", daemon=True).start()
        return True

    def uninstall(self) -> None:
        """Give SIGTERM and the wakeup fd back (main thread; elsewhere the flush is only
        switched off, so that a later SIGTERM kills at once)."""
        global _current
        self.flush = None
        if not self.installed or threading.current_thread() is not threading.main_thread():
            return
        self.installed = False
        with contextlib.suppress(Exception):
            if signal.getsignal(signal.SIGTERM) == self._on_signal:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with contextlib.suppress(Exception):
            previous = signal.set_wakeup_fd(-1)
            if previous != self._write_fd:  # someone else's since: theirs stays
                signal.set_wakeup_fd(previous)
        if _current is self:
            _current = None
        self.close_fds()  # the watcher reads the end of the pipe and returns

    # ------------------------------------------------------------------ the signal
    def _on_signal(self, signum: int, frame: Any) -> None:
        """Python's handler, on the main thread when it next runs Python. Called by a handler
        set later that chains to the one it replaced (Lightning's does), it does nothing: it
        stands for SIGTERM's default action, which such a handler never calls."""
        if signal.getsignal(signal.SIGTERM) == self._on_signal:
            self._finish()

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except InterruptedError:
                continue
            except OSError:
                return
            if not data:
                return
            # the handler set after attach (Lightning's SLURM requeue, a graceful shutdown)
            # owns SIGTERM: the wakeup fd is written for it too, and it must not be preempted
            if signal.SIGTERM in data and self.installed and (
                signal.getsignal(signal.SIGTERM) == self._on_signal
            ):
                self._finish()

    def _finish(self) -> None:
        with self._lock:
            first, self._started = not self._started, True
        if first:
            with contextlib.suppress(Exception):
                faulthandler.unregister(signal.SIGTERM)  # one stack dump, not one per signal
            flush = self.flush
            if flush is None or os.getpid() != self._pid:
                self._done.set()
            else:
                until = time.monotonic() + self.deadline
                threading.Thread(target=self._run_flush, args=(flush, until),
                                 name="ddpmon-sigterm-flush", daemon=True).start()
        self._done.wait(self.deadline)
        self._die()

    def _run_flush(self, flush: Callable[[float], None], until: float) -> None:
        try:
            flush(until)
        except Exception as exc:  # noqa: BLE001 - dying anyway; say why the flush stopped
            with contextlib.suppress(Exception):
                log.warning("ddpmon: the SIGTERM flush failed: %s", exc)
        finally:
            self._done.set()

    def _die(self) -> None:
        """Die of SIGTERM, as the process would have without ddpmon."""
        try:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            elif self._libc_signal is not None:
                self._libc_signal(signal.SIGTERM, 0)  # SIG_DFL, from any thread
            else:
                os._exit(128 + signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5.0)  # the signal is on its way to a thread that does not block it
        finally:
            os._exit(128 + signal.SIGTERM)

    def close_fds(self) -> None:
        for fd in (self._write_fd, self._read_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._read_fd = self._write_fd = -1


def _libc_signal() -> Callable[[int, int], Any] | None:
    """libc's ``signal()``: Python's ``signal.signal`` works on the main thread only, and the
    watcher must restore SIGTERM's default action while the main thread waits in C++."""
    try:
        import ctypes  # lazy: only a process that installs the flush needs it

        fn = ctypes.CDLL(None, use_errno=True).signal
        fn.restype = ctypes.c_void_p
        fn.argtypes = (ctypes.c_int, ctypes.c_void_p)
        return fn
    except Exception:  # noqa: BLE001 - without it the watcher exits with 128 + 15
        return None


_fork_hook_registered = False


def _register_fork_hook() -> None:
    global _fork_hook_registered
    if not _fork_hook_registered:  # register_at_fork has no undo: once per process
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_hook_registered = True


def _after_fork_in_child() -> None:
    """A forked child: SIGTERM's default action, no wakeup fd, no stack dump into the rank's
    SIGTERM file, and none of the parent's pipe."""
    global _current
    current, _current = _current, None
    if current is None:
        return
    current.installed = False
    current.flush = None
    with contextlib.suppress(Exception):
        faulthandler.unregister(signal.SIGTERM)
    with contextlib.suppress(Exception):
        signal.set_wakeup_fd(-1)
    with contextlib.suppress(Exception):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    current.close_fds()


__all__ = ["DEADLINE", "TermFlush"]
