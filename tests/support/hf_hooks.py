"""Test-only Transformers callbacks (imports ``transformers``; used by the integration workers)."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback


class ScaleReportedGradNorm(TrainerCallback):
    """Makes the Trainer's reported ``grad_norm`` wrong at one global step.

    Placed before ddpmon's callback, it scales ``logs["grad_norm"]`` in ``on_log`` (callbacks
    share that dict), as a trainer with a sharding bug would report it. ``state.log_history``
    keeps the true value.
    """

    def __init__(self, global_step: int, factor: float) -> None:
        self.global_step = global_step
        self.factor = factor

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any):
        if logs and "grad_norm" in logs and state.global_step == self.global_step:
            logs["grad_norm"] = logs["grad_norm"] * self.factor
