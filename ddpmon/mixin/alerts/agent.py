"""Alerts about ddpmon itself: a live reading that stopped working, or probes that fail.

A collector that never worked (NVML on a CPU host) is not an alert; one that worked in the last
hour and now fails is. Probe failures never stop training (they are counted), but the numbers
they feed are missing or stale while they fail.
"""

from __future__ import annotations

from ddpmon import metrics as m
from ddpmon.metrics import Layer
from ddpmon.mixin.alerts import RANK, Alert
from ddpmon.mixin.config import MixinConfig
from ddpmon.mixin.rules import sel

L = Layer.IDENTITY
WORKED_LOOKBACK = "1h"


def alerts(c: MixinConfig) -> list[Alert]:
    success = sel(c, m.COLLECTOR_SUCCESS.name)
    errors = sel(c, m.AGENT_ERRORS.name)
    return [
        Alert(
            "DdpmonAgentUnhealthy", L, "warning",
            f"(\n  max_over_time({success}[{WORKED_LOOKBACK}]) == 1\n"
            f"  and\n  max_over_time({success}[{c.gauge_window}]) == 0\n)\n"
            f"or\nincrease({errors}[{c.agent_errors_window}]) > 0",
            c.agent_unhealthy_for,
            "The ddpmon agent of a rank is failing to read some of its metrics.",
            f"{RANK}: {{{{ if $labels.collector }}}}the {{{{ $labels.collector }}}} collector "
            f"worked in the last {WORKED_LOOKBACK} and now fails{{{{ else }}}}probe "
            f"{{{{ $labels.probe }}}} failed about {{{{ $value | humanize }}}} time(s) in the "
            f"last {c.agent_errors_window}{{{{ end }}}}; training goes on, the series it feeds "
            "are missing or stale.",
        ),
    ]
