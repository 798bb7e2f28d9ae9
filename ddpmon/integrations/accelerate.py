"""What ddpmon takes from an ``accelerate.Accelerator``: its GradScaler and its setup.

The public home of these functions; they live in ``ddpmon.strategies.accelerate`` because
``attach(..., accelerator=...)`` reads them, and the agent imports no integration.
"""

from __future__ import annotations

from ..strategies.accelerate import (
    AcceleratorParts,
    deepspeed_engine,
    parts_from_accelerator,
    unwrap_optimizer,
)

__all__ = ["AcceleratorParts", "deepspeed_engine", "parts_from_accelerator", "unwrap_optimizer"]
