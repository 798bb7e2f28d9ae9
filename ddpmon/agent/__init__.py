"""The per-rank agent, as small parts: see ``monitor`` for how they fit together."""

from .api import NullMonitor, attach
from .clip import clip_grad_norm_
from .floor import LossScaleFloorError
from .monitor import Monitor
from .policy import NonFiniteGradientError
from .registry import monitor_for

__all__ = [
    "LossScaleFloorError",
    "Monitor",
    "NonFiniteGradientError",
    "NullMonitor",
    "attach",
    "clip_grad_norm_",
    "monitor_for",
]
