"""The per-rank agent, as small parts: see ``monitor`` for how they fit together."""

from ..clip import clip_grad_norm_
from .monitor import Monitor, NullMonitor, attach, monitor_for
from .policy import NonFiniteGradientError

__all__ = [
    "Monitor",
    "NonFiniteGradientError",
    "NullMonitor",
    "attach",
    "clip_grad_norm_",
    "monitor_for",
]
