"""Queries both dashboards share: the annotations drawn on every panel."""

from __future__ import annotations

from ddpmon.mixin.dashboards.promql import ALERT_SELECTOR

# One region per alert name and run, not per series: a stall of 1024 ranks is one region.
ANN_ALERTS = f"count by (run, alertname, severity) (ALERTS{{{ALERT_SELECTOR}}})"
ANN_NONFINITE = (
    "sum by (run, rank) (increase(ddpmon_grad_nonfinite_origin_steps_total{R}"
    "[$__rate_interval])) > 0"
)
ANN_SKIPPED = (
    "max by (run) (increase(ddpmon_amp_skipped_steps_total{R}[$__rate_interval])) > 0"
)
ANN_CHECKPOINTS = (
    "max by (run) (changes(ddpmon_checkpoint_last_timestamp_seconds{R}[$__rate_interval])) > 0"
)
"""A checkpoint save completed (any rank that reports them)."""
ANN_RESTARTS = "max by (run) (changes(ddpmon_attempt{R}[$__rate_interval])) > 0"
"""A restart: the ranks came back with a higher attempt number (torchelastic or a relaunch)."""
