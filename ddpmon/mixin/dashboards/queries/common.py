"""Queries both dashboards share: the annotations drawn on every panel."""

from __future__ import annotations

from ddpmon.mixin.dashboards.promql import ALERT_SELECTOR

ANN_ALERTS = f"ALERTS{{{ALERT_SELECTOR}}}"
ANN_NONFINITE = (
    "sum by (run, rank) (increase(ddpmon_grad_nonfinite_origin_steps_total{R}"
    "[$__rate_interval])) > 0"
)
ANN_SKIPPED = (
    "max by (run) (increase(ddpmon_amp_skipped_steps_total{R}[$__rate_interval])) > 0"
)
