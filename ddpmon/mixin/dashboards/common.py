"""What both dashboards share: the annotations drawn on every panel."""

from __future__ import annotations

from ddpmon.mixin.config import MixinConfig
from ddpmon.mixin.dashboards.model import Annotation
from ddpmon.mixin.dashboards.promql import expand
from ddpmon.mixin.dashboards.queries import common as Q


def annotations(cfg: MixinConfig) -> tuple[Annotation, ...]:
    return (
        Annotation("Firing ddpmon alerts", "red", expand(Q.ANN_ALERTS, cfg), "{{alertname}}"),
        Annotation(
            "Non-finite steps", "orange", expand(Q.ANN_NONFINITE, cfg),
            "non-finite gradients on rank {{rank}}",
        ),
        Annotation(
            "Skipped steps", "yellow", expand(Q.ANN_SKIPPED, cfg),
            "optimizer steps skipped by the loss scaler",
        ),
        Annotation("Checkpoints", "blue", expand(Q.ANN_CHECKPOINTS, cfg), "checkpoint saved"),
        Annotation(
            "Restarts", "purple", expand(Q.ANN_RESTARTS, cfg), "ranks restarted (new attempt)"
        ),
    )
