"""Crash and SIGTERM files of a run dir, read back as ``signal`` events for the timeline.

``crash.rank<R>.txt`` (faulthandler after a fatal signal) and ``sigterm.rank<R>.txt`` (stacks at
SIGTERM) are written where no Python code can run; the file's mtime times the event.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

SIGNALS = {
    "Segmentation fault": ("SIGSEGV", 11),
    "Aborted": ("SIGABRT", 6),
    "Bus error": ("SIGBUS", 7),
    "Floating-point exception": ("SIGFPE", 8),
    "Floating point exception": ("SIGFPE", 8),
    "Illegal instruction": ("SIGILL", 4),
}
_FATAL_RE = re.compile(r"Fatal Python error: (.+)")
_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


def crash_event(path: Path, rank: int) -> dict[str, Any] | None:
    try:
        text = path.read_text(errors="replace")
        mtime = path.stat().st_mtime
    except OSError:
        return None
    matches = _FATAL_RE.findall(text)
    if not matches:
        return None
    what = matches[-1].strip()
    name, num = SIGNALS.get(what, (what, None))
    return {"ts": mtime, "rank": rank, "kind": "signal", "signal": name, "signum": num,
            "synthetic": True, "source": path.name, "detail": f"Fatal Python error: {what}",
            "frame": top_frame(text[text.rfind("Fatal Python error"):])}


def sigterm_event(path: Path, rank: int) -> dict[str, Any] | None:
    try:
        text = path.read_text(errors="replace")
        mtime = path.stat().st_mtime
    except OSError:
        return None
    if not text.strip():
        return None
    return {"ts": mtime, "rank": rank, "kind": "signal", "signal": "SIGTERM", "signum": 15,
            "synthetic": True, "source": path.name, "frame": top_frame(text),
            "detail": "terminated (SIGTERM, usually the launcher stopping survivors)"}


def top_frame(text: str) -> str | None:
    """Innermost frame of the first (current) thread in a faulthandler dump."""
    m = _FRAME_RE.search(text)
    return f"{m.group(3)} ({m.group(1)}:{m.group(2)})" if m else None
