"""ddpmon: every rank of a distributed PyTorch job, observable on one time axis."""

from __future__ import annotations

__version__ = "0.2.0"

from .config import DEFAULT_PORT, Config, ConfigError  # noqa: E402

__all__ = [
    "DEFAULT_PORT",
    "Config",
    "ConfigError",
    "LossScaleFloorError",
    "Monitor",
    "__version__",
    "attach",
]


def __getattr__(name: str):
    # The agent imports torch; keep `import ddpmon` light for the CLI and the daemon.
    if name in ("attach", "Monitor", "clip_grad_norm_", "LossScaleFloorError"):
        from . import agent

        return getattr(agent, name)
    raise AttributeError(f"module 'ddpmon' has no attribute {name!r}")
