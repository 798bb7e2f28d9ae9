"""Crash and SIGTERM files of a run dir, read back as ``signal`` events for the timeline.

``crash.rank<R>.txt`` (faulthandler after a fatal signal) and ``sigterm.rank<R>.txt`` (stacks at
SIGTERM) are written where no Python code can run; the file's mtime times the event.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ..recorder.live_step import dumps, running
from ..rundir.damage import ReadWarnings
from ..rundir.safe_read import open_regular

SIGNALS = {
    "Segmentation fault": ("SIGSEGV", 11),
    "Aborted": ("SIGABRT", 6),
    "Bus error": ("SIGBUS", 7),
    "Floating-point exception": ("SIGFPE", 8),
    "Floating point exception": ("SIGFPE", 8),
    "Illegal instruction": ("SIGILL", 4),
}
_FATAL_RE = re.compile(r"Fatal Python error: (.+)")
_STACK_RE = re.compile(r'[Tt]hread 0x[0-9a-fA-F]+|File "')
"""What every faulthandler stack dump holds (a thread header or a frame)."""
_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


def crash_event(path: Path, rank: int, damage: ReadWarnings | None = None
                ) -> dict[str, Any] | None:
    """The ``signal`` event a faulthandler file records; None (and a warning in ``damage``)
    when it is unreadable or holds no ``Fatal Python error`` line."""
    damage = damage if damage is not None else ReadWarnings()
    got = _read(path, damage)
    if got is None:
        return None
    text, mtime = got
    written = dumps(text)
    fatal = [(live, body, at) for live, body, at in written if _FATAL_RE.search(body)]
    if not fatal:  # empty: opened at attach and never written (no fatal signal); not damage
        if written:
            damage.add(path, "no 'Fatal Python error' line (truncated or not a faulthandler "
                       "dump)", "no crash counted from it")
        return None
    live, body, at = fatal[-1]
    what = _FATAL_RE.findall(body)[-1].strip()
    name, num = SIGNALS.get(what, (what, None))
    return {"ts": mtime if at is None else at, "rank": rank, "kind": "signal", "signal": name,
            "signum": num, "synthetic": True, "source": path.name,
            "detail": f"Fatal Python error: {what}",
            "frame": top_frame(body[body.rfind("Fatal Python error"):]), **_live(live)}


def running_step(path: Path) -> dict[str, Any] | None:
    """``{"step", "phase", "pid"}`` of the step in progress when the newest attempt behind a
    crash file died without a dump (:func:`.live_step.running`); None if it dumped, ended
    normally (the line is cut then), or the file is unreadable (``crash_event`` says so)."""
    got = _read(path, ReadWarnings())
    return running(got[0]) if got is not None else None


def _live(live: dict[str, Any] | None) -> dict[str, Any]:
    """The step in progress when the signal came (the dump's live line), if it has one."""
    if live is None or live["step"] < 0:  # no line, or no step pipeline kept it
        return {}
    return {"live_step": live["step"], "phase": live["phase"]}


def sigterm_event(path: Path, rank: int, damage: ReadWarnings | None = None
                  ) -> dict[str, Any] | None:
    """The SIGTERM ``signal`` event of a stack dump; None (and a warning) when unreadable."""
    damage = damage if damage is not None else ReadWarnings()
    got = _read(path, damage)
    if got is None:
        return None
    text, mtime = got
    written = dumps(text)
    if not written:  # opened at attach and never written: no SIGTERM
        return None
    live, body, at = written[-1]
    if not _STACK_RE.search(body):
        damage.add(path, "no stack in it (truncated or not a faulthandler dump)",
                   "no SIGTERM counted from it")
        return None
    return {"ts": mtime if at is None else at, "rank": rank, "kind": "signal",
            "signal": "SIGTERM", "signum": 15,
            "synthetic": True, "source": path.name, "frame": top_frame(body),
            "detail": "terminated (SIGTERM, usually the launcher stopping survivors)",
            **_live(live)}


CRASH_FILE_BYTES = 4 << 20
"""Read at most this much of a crash or SIGTERM dump (faulthandler writes a few KB)."""


def _read(path: Path, damage: ReadWarnings) -> tuple[str, float] | None:
    """Text (bytes that are not UTF-8 replaced, and said so) and mtime of a crash file."""
    try:
        with open_regular(path) as fh:  # a FIFO in its place is damage, not a hang
            raw = fh.read(CRASH_FILE_BYTES + 1)
            mtime = os.fstat(fh.fileno()).st_mtime
    except OSError as exc:
        damage.add(path, f"unreadable ({exc.strerror or exc})", "skipped")
        return None
    if len(raw) > CRASH_FILE_BYTES:  # a stack dump is kilobytes: keep its head
        damage.add(path, f"over {CRASH_FILE_BYTES} bytes", "its first part used")
        raw = raw[:CRASH_FILE_BYTES]
    text = raw.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - raw.decode("utf-8", errors="ignore").count("\ufffd")
    if bad:
        damage.add(path, f"{bad} byte(s) not UTF-8", "replaced; the rest read")
    return text, mtime


_THREAD_RE = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+", re.MULTILINE)
_OWN_NAMES = sorted(
    p.name for p in Path(__file__).resolve().parents[1].iterdir()
    if p.name != "demo" and not p.name.startswith(("_", ".")) and (p.suffix == ".py" or p.is_dir())
) + ["__init__.py"]
_OWN_RE = re.compile(
    r"[/\\]ddpmon[/\\](?:" + "|".join(re.escape(n) for n in _OWN_NAMES) + r")(?:[/\\]|$)"
)
"""ddpmon's own code (its watchdog, hooks, writers), by the names of this package's modules and
subpackages. ``ddpmon/demo`` is a training script; a user's dir named ``ddpmon`` matches only
where a file of it has the name of one of ddpmon's."""
_LIBRARY_RE = re.compile(r"[/\\](?:site|dist)-packages[/\\]|[/\\]lib[/\\]python3\.\d+[/\\]")


def _frames(block: str) -> list[re.Match[str]]:
    return list(_FRAME_RE.finditer(block))


def _thread_blocks(text: str) -> list[tuple[bool, str]]:
    """(is the current thread, its text) for each thread of a dump; one unnamed block when the
    dump has no thread headers (``all_threads=False``)."""
    heads = list(_THREAD_RE.finditer(text))
    if not heads:
        return [(True, text)]
    ends = [h.start() for h in heads[1:]] + [len(text)]
    return [
        (h.group(1) == "Current thread", text[h.start():end])
        for h, end in zip(heads, ends, strict=True)
    ]


def top_frame(text: str) -> str | None:
    """The frame to name for a faulthandler dump: in the current thread (faulthandler lists it
    among the others, not first), the innermost frame of the training code. ddpmon's own frames
    and library frames (the stdlib, site-packages: torch's backward, a DataLoader's queue) are
    passed over to the caller that entered them; when the stack has nothing else, its innermost
    frame is named."""
    blocks = _thread_blocks(text)
    current = [block for is_current, block in blocks if is_current]
    frames = _frames(current[0] if current else blocks[0][1])
    if not frames:
        return None
    theirs = [m for m in frames if not _OWN_RE.search(m.group(1))]
    user = [m for m in theirs if not _LIBRARY_RE.search(m.group(1))]
    m = (user or theirs or frames)[0]
    return f"{m.group(3)} ({m.group(1)}:{m.group(2)})"
