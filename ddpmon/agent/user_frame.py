"""The innermost frame of user code on a thread, read from this process's own stacks.

A hung rank's training thread cannot say where it is, but another thread of the same process
can: ``sys._current_frames()`` holds every thread's newest frame. The innermost frame that is
not torch's, ddpmon's, the standard library's or an installed package's is where the user's loop
stands (a dataset's ``__getitem__``, the line that called ``all_reduce``, a loop spinning on a
file). No external tool (py-spy, gdb) and no signal: a read of the interpreter's own state.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from types import FrameType

import torch

from ..terminal import clean_line

MAX_FRAME_CHARS = 160
"""A frame is a label value: kept short (a long path is cut from the left)."""


def _library_roots() -> tuple[str, ...]:
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ddpmon/
    roots = {os.path.dirname(torch.__file__), package}
    paths = sysconfig.get_paths()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        if paths.get(key):
            roots.add(paths[key])
    return tuple(sorted(os.path.realpath(r) + os.sep for r in roots))


_ROOTS: tuple[str, ...] | None = None


def is_user_file(filename: str) -> bool:
    """A frame of the user's code: a real file outside torch, ddpmon, the standard library
    and installed packages (``<frozen ...>`` and ``<string>`` are not files)."""
    global _ROOTS
    if _ROOTS is None:
        _ROOTS = _library_roots()
    if not filename or filename.startswith("<"):
        return False
    path = os.path.realpath(filename)
    return not path.startswith(_ROOTS)


def describe(frame: FrameType) -> str:
    """``file.py:57 in load_batch``, cleaned for a terminal and a label, at most
    ``MAX_FRAME_CHARS`` characters."""
    code = frame.f_code
    text = clean_line(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}")
    return text if len(text) <= MAX_FRAME_CHARS else "..." + text[-(MAX_FRAME_CHARS - 3):]


def innermost_user_frame(thread_id: int) -> str | None:
    """Where ``thread_id`` stands in user code now (its innermost frame if none is the user's);
    None when the thread is gone."""
    frame = sys._current_frames().get(thread_id)  # noqa: SLF001 - documented CPython API
    innermost = frame
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
            return describe(frame)
        frame = frame.f_back
    return describe(innermost) if innermost is not None else None
