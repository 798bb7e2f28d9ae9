"""The step in progress, kept where a fatal signal's stack dump is written.

A faulthandler dump runs inside the signal handler: no Python code can say which step was
running, and the progress file (written about every 50 ms, off the training thread) lags. So each
attempt appends one fixed-width line to the crash (and SIGTERM) file before faulthandler can
write there::

    ddpmon-live: step=000000000070 phase=B pid=0000004242 before=0000000000.000000

and the training thread rewrites its digits in place through a shared file mapping: a memory
store per step, no system call. The kernel owns the mapped page, so the newest value is in the
file after any death, SIGSEGV or SIGKILL alike; the dump that follows the line is that attempt's.
``before`` is the file's mtime when the line was appended (0: the file was empty): the time of
the previous attempt's dump, which the file's own mtime no longer tells once a later attempt
has written to it.

``phase``: ``D`` before the step's first forward (data loading, ``zero_grad``, logging), ``F``
forward or backward, ``B`` after backward (clipping, the scaler), ``O`` inside the optimizer step,
``C`` inside a checkpoint save or load timed on the training thread (``observe_checkpoint``).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
from typing import Any, BinaryIO

log = logging.getLogger("ddpmon.crash")

PREFIX = b"ddpmon-live: step="
_LINE = PREFIX + b"%012d phase=%c pid=%010d before=%017.6f\n"
_STEP_AT = len(PREFIX)
_PHASE_AT = _STEP_AT + 12 + len(b" phase=")
LINE_LEN = len(_LINE % (0, ord("D"), 0, 0.0))
LINE_RE = re.compile(
    r"ddpmon-live: step=(-?\d{1,12}) phase=([A-Z]) pid=(\d{1,10}) before=(\d{1,10}\.\d{6})\n"
)
"""One attempt's line, as read back (:func:`dumps`)."""

PHASES = {"D": "before its forward", "F": "in forward or backward", "B": "after backward",
          "O": "in the optimizer step", "C": "in a checkpoint save or load"}
DATA, FORWARD, AFTER_BACKWARD, OPTIMIZER, CHECKPOINT = (ord(c) for c in "DFBOC")


class _Slot:
    """One file's line: where it starts, and the mapping over it."""

    __slots__ = ("path", "start", "mapping", "offset", "before")

    def __init__(self, path: str, start: int, mapping: mmap.mmap, offset: int,
                 before: float) -> None:
        self.path, self.start, self.mapping, self.offset = path, start, mapping, offset
        self.before = before


class LiveStep:
    """Appends the line to each dump file and keeps it current. Never raises into training:
    a file that cannot be mapped is left without a line (the timeline then falls back to the
    last completed step)."""

    def __init__(self) -> None:
        self._slots: list[_Slot] = []
        self.step = -1
        """-1 until a step pipeline says otherwise (crash capture without an agent)."""

    def add(self, fh: BinaryIO | Any) -> None:
        """Append the line to the open dump file ``fh`` (append mode) and map it."""
        try:
            fh.flush()
            st = os.fstat(fh.fileno())
            start = st.st_size
            before = st.st_mtime if start else 0.0
            line = _LINE % (self.step, DATA, os.getpid(), before)
            os.write(fh.fileno(), line)
            base = start - start % mmap.ALLOCATIONGRANULARITY
            fd = os.open(fh.name, os.O_RDWR | os.O_CLOEXEC)
            try:
                mapping = mmap.mmap(fd, start + len(line) - base, offset=base)
            finally:
                os.close(fd)
            self._slots.append(_Slot(fh.name, start, mapping, start - base, before))
        except Exception as exc:
            log.debug("ddpmon: no live step in %s: %s", getattr(fh, "name", fh), exc)

    def set(self, step: int, phase: int) -> None:
        """Hot path: the step in progress and its phase (one slice store per file)."""
        if step != self.step:
            self.step = step
            digits = b"%012d" % (step if 0 <= step < 10**12 else -1)
            for slot in self._slots:
                try:
                    slot.mapping[slot.offset + _STEP_AT:slot.offset + _STEP_AT + 12] = digits
                except Exception:
                    pass
        for slot in self._slots:
            try:
                slot.mapping[slot.offset + _PHASE_AT] = phase
            except Exception:
                pass

    def release(self) -> list[tuple[str, int, float]]:
        """Unmap; returns each file with the offset its line starts at and the file's mtime
        before it (for the caller to cut the line off again when nothing followed it, leaving
        the file as it was: an earlier attempt's dump is timed by that mtime)."""
        out = []
        for slot in self._slots:
            try:
                slot.mapping.close()
            except Exception:
                pass
            out.append((slot.path, slot.start, slot.before))
        self._slots.clear()
        return out


class _NoLive:
    """No crash capture (an unwritable run dir): nothing to keep current."""

    def set(self, step: int, phase: int) -> None:
        pass


NO_LIVE = _NoLive()
"""Where a step pipeline without crash capture keeps its step in progress: nowhere."""


def _fields(match: re.Match[str]) -> dict[str, Any]:
    return {"step": int(match.group(1)), "phase": PHASES.get(match.group(2), match.group(2)),
            "pid": int(match.group(3))}


def dumps(text: str) -> list[tuple[dict[str, Any] | None, str, float | None]]:
    """The dumps of a crash or SIGTERM file, oldest first: the live line that came before each
    (``{"step", "phase", "pid"}``; None for a file written without one), its text, and when it
    was written if a later line says so (that line's ``before``; None for the newest dump, which
    the file's mtime times). A live line that nothing followed (an attempt that was not
    signalled) yields nothing."""
    out: list[tuple[dict[str, Any] | None, str, float | None]] = []
    live, pos = None, 0
    for match in LINE_RE.finditer(text):
        before = float(match.group(4))
        out.append((live, text[pos:match.start()], before if before > 0 else None))
        live, pos = _fields(match), match.end()
    out.append((live, text[pos:], None))
    return [(fields, body, at) for fields, body, at in out if body.strip()]


def running(text: str) -> dict[str, Any] | None:
    """The live line that ends a crash file with nothing after it: the newest attempt's step in
    progress when its process died without a dump (SIGKILL, the OOM killer, ``os._exit``: the
    kernel wrote the mapped page back). None when the file ends with a dump, or the line holds
    no step."""
    lines = list(LINE_RE.finditer(text))
    last = lines[-1] if lines else None
    if last is None or text[last.end():].strip():
        return None
    fields = _fields(last)
    return fields if fields["step"] >= 0 else None
