"""ddpmon: every rank of a distributed PyTorch job, observable on one time axis."""

from __future__ import annotations

from ._version import __version__
from .config import DEFAULT_PORT, Config, ConfigError

__all__ = [
    "DEFAULT_PORT",
    "Config",
    "ConfigError",
    "LossScaleFloorError",
    "Monitor",
    "StepRecord",
    "__version__",
    "attach",
]


def __getattr__(name: str):
    # The agent imports torch; keep `import ddpmon` light for the CLI and the daemon.
    if name in ("attach", "Monitor", "clip_grad_norm_", "LossScaleFloorError"):
        from . import agent  # torch: `import ddpmon` stays light

        return getattr(agent, name)
    if name == "StepRecord":  # what a sink gets (attach(sinks=[...])), from ddpmon.metrics.state
        from .metrics.state import StepRecord  # kept lazy like the names above: a light import

        return StepRecord
    raise AttributeError(f"module 'ddpmon' has no attribute {name!r}")
