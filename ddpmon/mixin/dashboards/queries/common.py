"""Queries both dashboards share: the annotations drawn on every panel."""

from __future__ import annotations

from ddpmon import metrics as m
from ddpmon.mixin.dashboards.promql import ALERT_SELECTOR

# One region per alert name and run, not per series: a stall of 1024 ranks is one region.
ANN_ALERTS = f"count by (run, alertname, severity) (ALERTS{{{ALERT_SELECTOR}}})"
ANN_NONFINITE = (
    f"sum by (run, rank) (increase({m.GRAD_NONFINITE_ORIGIN_STEPS.name}{{R}}"
    "[$__rate_interval])) > 0"
)
ANN_SKIPPED = (
    f"max by (run) (increase({m.STEPS_SKIPPED.name}{{R}}[$__rate_interval])) > 0"
)
"""A step was skipped, by anyone (the loss scaler, DeepSpeed, the loop, the skip policy)."""
ANN_CHECKPOINTS = (
    f"max by (run) (changes({m.CHECKPOINT_LAST_TIMESTAMP.name}{{R}}[$__rate_interval])) > 0"
)
"""A checkpoint save completed (any rank that reports them)."""
ANN_RESTARTS = f"max by (run) (changes({m.ATTEMPT.name}{{R}}[$__rate_interval])) > 0"
"""A restart: the ranks came back with a higher attempt number (torchelastic or a relaunch)."""
