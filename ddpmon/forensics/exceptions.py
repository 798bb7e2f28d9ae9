"""What an exception that ended a rank means: the one place where ``exit`` events are read.

An ``exit`` event (``reason="exception"``) carries the exception's type name, its message and
its formatted traceback as text (never the object: nothing is unpickled). They are read in this
order, the first rule that matches decides the ``cause``:

- ``memory``: ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` is the same class),
  Python's ``MemoryError``, or a message saying "out of memory";
- ``data``: raised inside the data pipeline: a frame of ``torch/utils/data/`` in the traceback (a
  ``Dataset.__getitem__``, a sampler or a collate function called by the DataLoader), or a
  DataLoader worker's error re-raised in the main process ("in DataLoader worker process");
  ``frame`` then names the user's own innermost frame (e.g. the dataset's ``__getitem__``);
- ``communication``: a collective timeout or a backend error (gloo, NCCL, a peer's connection);
- ``numerics``: a non-finite value: torch's ``clip_grad_norm_(error_if_nonfinite=True)`` (which
  Lightning Fabric's ``clip_gradients`` calls), anomaly detection ("returned nan values"), or a
  user's guard that says so ("loss is nan", "non-finite", ``isfinite``); ddpmon's own
  ``NonFiniteGradientError`` and ``LossScaleFloorError`` too (its ``raise`` policies);
- ``process``: anything else.

The tables below are the rules; ``docs/forensics/timeline.md`` lists them with real examples.
"""

from __future__ import annotations

import re
from typing import Any

from .crash_files import _LIBRARY_RE, _OWN_RE

MEMORY_TYPES = frozenset({"OutOfMemoryError", "MemoryError"})
MEMORY_MESSAGE = re.compile(r"out of memory", re.IGNORECASE)

DATA_FRAME = re.compile(r'File "[^"]*[/\\]torch[/\\]utils[/\\]data[/\\]')
DATA_MESSAGE = re.compile(r"in DataLoader worker process|DataLoader worker \(pid", re.IGNORECASE)

COMM_MESSAGE = re.compile(
    r"gloo|nccl|connection|timed out|timeout|peer|socket|processgroup|distbackenderror|"
    r"distnetworkerror|broken pipe",
    re.IGNORECASE,
)
COMM_TYPES = frozenset({"DistBackendError", "DistNetworkError", "DistStoreError",
                        "DistError", "TimeoutError", "ConnectionError", "BrokenPipeError",
                        "ConnectionResetError"})

NUMERICS_TYPES = frozenset({"NonFiniteGradientError", "LossScaleFloorError",
                            "FloatingPointError"})
NUMERICS_MESSAGE = re.compile(
    r"non-?finite|not finite|isfinite|\bnan\b|\binf(inity)?\b|returned nan values|"
    r"loss scale already at minimum",
    re.IGNORECASE,
)
ANOMALY = re.compile(r"Function '(\w+)' returned nan values")
"""``torch.autograd.set_detect_anomaly``: the backward function that produced the NaN."""

REACTIONS = frozenset({"NonFiniteGradientError", "LossScaleFloorError"})
"""ddpmon's own ``raise`` policies: the non-finite event they follow is the failure."""

_FRAME = re.compile(r'File "([^"]+)", line (\d+),? in (\S+)')


def read_exception(exc_type: Any, message: Any, traceback: Any = None) -> dict[str, Any]:
    """``{"cause": layer}`` of an exception, plus ``frame`` (the user's innermost frame) for a
    data error and ``tensor`` when anomaly detection named a backward function. Pure: text in,
    text out; any field may be missing or of the wrong type (a damaged event)."""
    name = exc_type if isinstance(exc_type, str) else ""
    text = message if isinstance(message, str) else ""
    tb = traceback if isinstance(traceback, str) else ""
    if name in MEMORY_TYPES or MEMORY_MESSAGE.search(text):
        return {"cause": "memory"}
    if DATA_MESSAGE.search(text) or DATA_FRAME.search(tb):
        out: dict[str, Any] = {"cause": "data"}
        frame = user_frame(tb or text)
        if frame:
            out["frame"] = frame
        return out
    if name in COMM_TYPES or COMM_MESSAGE.search(f"{name} {text}"):
        return {"cause": "communication"}
    if name in NUMERICS_TYPES or NUMERICS_MESSAGE.search(text):
        out = {"cause": "numerics"}
        anomaly = ANOMALY.search(text)
        if anomaly:
            out["tensor"] = anomaly.group(1)
        return out
    return {"cause": "process"}


def user_frame(traceback: str) -> str | None:
    """The innermost frame of the user's code in a Python traceback (innermost last; a
    DataLoader worker's original traceback, quoted in the message, comes last and wins):
    ``name (file:line)``. ddpmon's and library frames are passed over; None when none is
    left."""
    frames = [m for m in _FRAME.finditer(traceback)
              if not _OWN_RE.search(m.group(1)) and not _LIBRARY_RE.search(m.group(1))]
    if not frames:
        return None
    m = frames[-1]
    return f"{m.group(3)} ({m.group(1)}:{m.group(2)})"
