"""ddpmon's own exceptions, and how DeepSpeed's loss-scale exception is told apart: a leaf
module, so that every layer (the agent, the strategies) can import it without reaching up."""

from __future__ import annotations

DEEPSPEED_MIN_SCALE = "loss scale already at minimum"
"""Text of DeepSpeed's ``DynamicLossScaler`` exception at its ``min_loss_scale``."""


class NonFiniteGradientError(FloatingPointError):
    """Raised by ``on_nonfinite='raise'`` (names the rank, step and parameter), and by
    ``on_nonfinite='rerun'`` on every rank when a rerun reproduces the fault."""


class LossScaleFloorError(RuntimeError):
    """Raised by ``on_loss_scale_floor="raise"`` on every rank at the same step, with one message
    naming the step, the scale, the overflows' origin ranks and the last checkpoint."""

    def __init__(self, message: str, *, step: int, loss_scale: float | None,
                 origin_ranks: list[int], checkpoint: dict | None) -> None:
        super().__init__(message)
        self.step = step
        self.loss_scale = loss_scale
        self.origin_ranks = origin_ranks
        self.checkpoint = checkpoint


def is_deepspeed_min_scale(exc: BaseException) -> bool:
    return type(exc) is Exception and DEEPSPEED_MIN_SCALE in str(exc)
