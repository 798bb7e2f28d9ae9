"""Alerts about checkpoints: none saved for too long while training goes on, or saves eating
too much of the wall time.

Only ranks that save checkpoints and tell ddpmon (``observe_checkpoint``, or DCP captured) have
the series, so a run that never checkpoints never fires; a run that stopped stepping is the stall
alerts' business, not these.
"""

from __future__ import annotations

from ddpmon import metrics as m
from ddpmon.metrics import Layer
from ddpmon.mixin.alerts import RANK, Alert
from ddpmon.mixin.config import MixinConfig
from ddpmon.mixin.rules import sel

L = Layer.IDENTITY


def alerts(c: MixinConfig) -> list[Alert]:
    last = sel(c, m.CHECKPOINT_LAST_TIMESTAMP.name)
    heartbeat = sel(c, m.LAST_STEP_TIMESTAMP.name)
    saves = sel(c, m.CHECKPOINT_DURATION.sample("sum"), 'kind="save"')
    stale = f"{c.checkpoint_stale_seconds:g}"
    share, percent = f"{c.checkpoint_slow_share:g}", f"{c.checkpoint_slow_share:.0%}"
    return [
        Alert(
            "DdpmonCheckpointStale", L, "warning",
            f"(time() - {last} > {stale})\nand\n(time() - {heartbeat} < {stale})",
            c.checkpoint_stale_for,
            "A rank that saves checkpoints has not saved one for too long while training goes on.",
            f"{RANK}: the last checkpoint was saved {{{{ $value | humanizeDuration }}}} ago "
            f"(threshold {stale}s) and steps still complete; a failure now loses all the "
            "steps since.",
        ),
        Alert(
            "DdpmonCheckpointSlow", L, "warning",
            f"rate({saves}[{c.checkpoint_slow_window}]) > {share}",
            c.checkpoint_slow_for,
            "Checkpoint saves take too large a share of a rank's wall time.",
            f"{RANK}: checkpoint saves took {{{{ $value | humanizePercentage }}}} of the wall "
            f"time over the last {c.checkpoint_slow_window} (threshold {percent}).",
        ),
    ]
